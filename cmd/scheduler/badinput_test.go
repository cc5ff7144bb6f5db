package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

// smallTopic is a target whose max.message.bytes is smallMax.
const (
	smallTopic = "orders.small"
	smallMax   = 2048
)

// badCase is one record of TestBadInputAtScale and what must become of it.
// The header "case" (first, or after the control headers for kcat records)
// names it, in the database and in the target topic.
type badCase struct {
	name    string
	key     []byte // nil: no key
	value   []byte // nil: a tombstone
	headers []sarama.RecordHeader
	kcat    bool // produced with kcat rather than sarama

	// What must become of it. state "delivered": republished and deleted;
	// otherwise the row stays with this state.
	state string
	// reason must start with this (the code, and for publish failures the
	// kind).
	reason string
	// bizKey is the stored business key; nil: unordered. Checked on rows
	// that stay.
	bizKey *string
	// runAt, if set, is the stored next_run_at.
	runAt time.Time
}

func hdrs(kv ...string) []sarama.RecordHeader {
	var out []sarama.RecordHeader
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, sarama.RecordHeader{Key: []byte(kv[i]), Value: []byte(kv[i+1])})
	}
	return out
}

func ptr[T any](v T) *T { return &v }

// randomBytes returns n bytes of every value, so that no encoding could pass
// them through by luck.
func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.UintN(256))
	}
	return b
}

// createTopic creates a topic with the given configs.
func createTopic(t *testing.T, brokers, topic string, configs map[string]string) {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	admin, err := sarama.NewClusterAdmin([]string{brokers}, c)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	entries := map[string]*string{}
	for k, v := range configs {
		entries[k] = &v
	}
	if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 4, ReplicationFactor: 1, ConfigEntries: entries}, false); err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
}

// TestBadInputAtScale sends one running service the awkward records a
// defer topic sees in practice (huge values, thousands of headers, binary
// keys and header values, tombstones, odd time zones, impossible dates and
// delays, illegal target names, a record its target refuses, and a flood of
// rejects in one partition) and checks what it stores and republishes,
// byte for byte.
func TestBadInputAtScale(t *testing.T) {
	kc := kcat(t)
	// Room for a 1 MiB value in the defer topic: Kafka's default limit
	// (1048588 bytes a batch) is just short of a 1 MiB value with its
	// record overhead.
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic),
		kfake.BrokerConfigs(map[string]string{"message.max.bytes": strconv.Itoa(4 << 20)}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	brokers := cluster.ListenAddrs()[0]
	createTopic(t, brokers, smallTopic, map[string]string{"max.message.bytes": strconv.Itoa(smallMax)})

	db := pgtest.NewDB(t)
	ctx := context.Background()
	const maxDelay = 17520 * time.Hour // two years: 2028-02-29 is in range
	env := append(serviceEnv(db.URL, brokers, "e2e-badinput"), "MAX_DELAY="+maxDelay.String())

	var (
		mu        sync.Mutex
		delivered = map[string][]*sarama.ConsumerMessage{}
	)
	rawConsumer(t, brokers, targetTopic, func(m *sarama.ConsumerMessage) {
		name := hdr(m, "case")
		mu.Lock()
		delivered[name] = append(delivered[name], m)
		mu.Unlock()
	})
	rawConsumer(t, brokers, smallTopic, func(m *sarama.ConsumerMessage) {
		t.Errorf("%s got a record of %d bytes, more than its max.message.bytes", smallTopic, len(m.Value))
	})

	now := time.Now()
	// A due time an hour ahead, with nanoseconds, in the given zone.
	ahead := func(offset string) (string, time.Time) {
		sign := 1
		if offset[0] == '-' {
			sign = -1
		}
		h, _ := strconv.Atoi(offset[1:3])
		m, _ := strconv.Atoi(offset[4:6])
		zone := time.FixedZone(offset, sign*(h*3600+m*60))
		at := now.Add(time.Hour).Truncate(time.Second).Add(123456789).In(zone)
		text := at.Format(time.RFC3339Nano)
		if !strings.HasSuffix(text, offset) {
			t.Fatalf("%s does not end in %s", text, offset)
		}
		return text, at
	}
	ctl := func(kv ...string) []sarama.RecordHeader {
		return hdrs(append([]string{"defer.target", targetTopic}, kv...)...)
	}
	withCase := func(name string, h []sarama.RecordHeader) []sarama.RecordHeader {
		return append([]sarama.RecordHeader{{Key: []byte("case"), Value: []byte(name)}}, h...)
	}

	var cases []badCase
	add := func(c badCase) {
		if !c.kcat {
			c.headers = withCase(c.name, c.headers)
		}
		cases = append(cases, c)
	}

	// Sizes. sarama's producer in the service refuses records over its
	// Producer.MaxMessageBytes (1 MB, not configurable): just under
	// goes through, exactly 1 MiB of value is parked.
	add(badCase{name: "value just under 1 MiB", key: []byte("big-1"), value: randomBytes(1<<20 - 4096),
		headers: ctl("defer.delay", "0"), state: "delivered"})
	add(badCase{name: "value of 1 MiB", key: []byte("big-2"), value: randomBytes(1 << 20),
		headers: ctl("defer.delay", "0"), state: "parked", reason: "too_large:", bizKey: ptr("big-2")})
	add(badCase{name: "larger than the target accepts", key: []byte("small-1"), value: randomBytes(2 * smallMax),
		headers: hdrs("defer.target", smallTopic, "defer.delay", "0"), state: "parked", reason: "too_large:", bizKey: ptr("small-1")})
	// Behind the parked one: the default policy's parking holds the key.
	add(badCase{name: "behind the too large one", key: []byte("small-1"), value: []byte("next"),
		headers: ctl("defer.delay", "0"), state: "pending", bizKey: ptr("small-1")})

	many := ctl("defer.delay", "0")
	for i := range 5000 {
		name := fmt.Sprintf("h-%d", i)
		if i%2 == 0 {
			name = "dup" // duplicates, interleaved
		}
		many = append(many, sarama.RecordHeader{Key: []byte(name), Value: randomBytes(i % 7)})
	}
	add(badCase{name: "5000 headers", key: []byte("many"), value: []byte("v"), headers: many, state: "delivered"})

	// Keys and values.
	add(badCase{name: "empty key", key: []byte{}, value: []byte("v"), headers: ctl("defer.delay", "0"), state: "delivered"})
	add(badCase{name: "null key", value: []byte("v"), headers: ctl("defer.delay", "0"), state: "delivered"})
	add(badCase{name: "empty key, stored", key: []byte{}, value: []byte{}, headers: ctl("defer.delay", "1h"), state: "pending"})
	binHdrs := func(name string) []sarama.RecordHeader {
		return append(hdrs("case", name, "defer.target", targetTopic), sarama.RecordHeader{Key: []byte("bin"), Value: []byte("\xff\x80")},
			sarama.RecordHeader{Key: []byte("bin"), Value: []byte("\xc3\x28")}, sarama.RecordHeader{Key: []byte("text"), Value: []byte("ü")})
	}
	// kcat: a tombstone (-Z sends the empty line as NULL) with a binary key
	// and binary, duplicated header values.
	add(badCase{name: "tombstone", kcat: true, key: []byte("\xff\xfe-tomb"),
		headers: append(binHdrs("tombstone"), hdrs("defer.delay", "0")...), state: "delivered"})
	add(badCase{name: "binary key, stored", kcat: true, key: []byte("\xff\xfe"), value: []byte("x"),
		headers: append(binHdrs("binary key, stored"), hdrs("defer.delay", "1h")...), state: "pending", bizKey: ptr(`\xfffe`)})

	// Times.
	for _, off := range []string{"+14:00", "-12:00", "+05:45"} {
		text, at := ahead(off)
		add(badCase{name: "at " + off, key: []byte("at" + off), value: []byte("v"), headers: ctl("defer.at", text),
			state: "pending", bizKey: ptr("at" + off), runAt: at.Truncate(time.Microsecond)})
	}
	leap := time.Date(2028, 2, 29, 22, 59, 59, 999999000, time.UTC)
	add(badCase{name: "leap day", key: []byte("leap"), value: []byte("v"), headers: ctl("defer.at", "2028-02-29T23:59:59.999999999+01:00"),
		state: "pending", bizKey: ptr("leap"), runAt: leap})
	add(badCase{name: "no 2027-02-29", key: []byte("k"), value: []byte("v"), headers: ctl("defer.at", "2027-02-29T12:00:00Z"),
		state: "rejected", reason: "invalid_at:"})
	add(badCase{name: "negative delay", key: []byte("k"), value: []byte("v"), headers: ctl("defer.delay", "-1s"),
		state: "rejected", reason: "invalid_delay:"})
	add(badCase{name: "beyond MAX_DELAY", key: []byte("k"), value: []byte("v"), headers: ctl("defer.delay", (maxDelay + time.Hour).String()),
		state: "rejected", reason: "delay_too_long:"})
	add(badCase{name: "max int64 ns", key: []byte("k"), value: []byte("v"), headers: ctl("defer.delay", "9223372036854775807ns"),
		state: "rejected", reason: "delay_too_long:"})

	// Target names Kafka forbids, all matching TARGET_TOPICS=orders.* but
	// for the slash.
	for _, target := range []string{"orders./x", "orders. x", "orders.*", "orders.ü", "orders." + strings.Repeat("x", 243)} {
		add(badCase{name: "target " + target[:min(len(target), 12)] + fmt.Sprint(len(target)), key: []byte("k"), value: []byte("v"),
			headers: hdrs("defer.target", target, "defer.delay", "0"), state: "rejected", reason: "invalid_target:"})
	}

	svc := start(t, env)
	prod := largeProducer(t, brokers, nil)
	for _, c := range cases {
		if c.kcat {
			kcatProduce(t, kc, brokers, c)
			continue
		}
		m := &sarama.ProducerMessage{Topic: deferTopic, Headers: c.headers}
		if c.key != nil {
			m.Key = sarama.ByteEncoder(c.key)
		}
		if c.value != nil {
			m.Value = sarama.ByteEncoder(c.value)
		}
		if _, _, err := prod.SendMessage(m); err != nil {
			t.Fatalf("%s: produce: %v", c.name, err)
		}
	}

	// The flood: rejects in one partition, with valid records in between.
	const floodBad, floodGood = 5000, 500
	flood := largeProducer(t, brokers, sarama.NewManualPartitioner)
	var batch []*sarama.ProducerMessage
	for i := range floodBad + floodGood {
		m := &sarama.ProducerMessage{Topic: deferTopic, Partition: 0, Value: sarama.StringEncoder("flood-" + strconv.Itoa(i))}
		if i%11 == 0 {
			m.Headers = hdrs("case", "flood", "defer.target", targetTopic, "defer.delay", "0")
		} else {
			// The reason cycles through three codes; n says which.
			switch i % 3 {
			case 0:
				m.Headers = hdrs("flood-bad", "", "n", strconv.Itoa(i), "defer.delay", "0")
			case 1:
				m.Headers = hdrs("flood-bad", "", "n", strconv.Itoa(i), "defer.target", targetTopic, "defer.delay", "soon")
			case 2:
				m.Headers = hdrs("flood-bad", "", "n", strconv.Itoa(i), "defer.target", "payments.retry", "defer.delay", "0")
			}
		}
		batch = append(batch, m)
		if len(batch) == 500 {
			if err := flood.SendMessages(batch); err != nil {
				t.Fatalf("flood: %v", err)
			}
			batch = nil
		}
	}
	if err := flood.SendMessages(batch); err != nil {
		t.Fatalf("flood: %v", err)
	}
	goodFlood := 0
	for i := range floodBad + floodGood {
		if i%11 == 0 {
			goodFlood++
		}
	}
	badFlood := floodBad + floodGood - goodFlood

	// Deliveries.
	wantDelivered := 0
	for _, c := range cases {
		if c.state == "delivered" {
			wantDelivered++
		}
	}
	deadline := time.Now().Add(45 * time.Second)
	for {
		mu.Lock()
		n, f := 0, len(delivered["flood"])
		for _, c := range cases {
			if c.state == "delivered" && len(delivered[c.name]) > 0 {
				n++
			}
		}
		mu.Unlock()
		if n == wantDelivered && f >= goodFlood {
			break
		}
		if time.Now().After(deadline) {
			var missing []string
			mu.Lock()
			for _, c := range cases {
				if c.state == "delivered" && len(delivered[c.name]) == 0 {
					missing = append(missing, c.name)
				}
			}
			mu.Unlock()
			rows, _ := db.Pool.Query(ctx, "SELECT id, state, coalesce(reason, ''), convert_from(header_values[array_position(header_keys, 'case')], 'UTF8'), key, value IS NULL FROM deferred_message WHERE 'case' = ANY(header_keys)")
			for rows.Next() {
				var id int64
				var st, r, cn string
				var k []byte
				var vn bool
				rows.Scan(&id, &st, &r, &cn, &k, &vn)
				t.Logf("row %d %s %q case %q key %q null value %v", id, st, r, cn, k, vn)
			}
			rows.Close()
			t.Fatalf("after 45s: %d of %d cases and %d of %d flood records delivered; missing %q", n, wantDelivered, f, goodFlood, missing)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	got := map[string][]*sarama.ConsumerMessage{}
	for k, v := range delivered {
		got[k] = slices.Clone(v)
	}
	mu.Unlock()

	for _, c := range cases {
		if c.state != "delivered" {
			if len(got[c.name]) > 0 {
				t.Errorf("%s: republished, want it %s", c.name, c.state)
			}
			continue
		}
		m := got[c.name][0]
		checkBytes(t, c.name+": republished key", m.Key, c.key)
		checkBytes(t, c.name+": republished value", m.Value, c.value)
		// Same headers in the same order, minus the one-shot ones, plus
		// what the scheduler sets, appended.
		var want []sarama.RecordHeader
		for _, h := range c.headers {
			if k := string(h.Key); k != "defer.delay" && k != "defer.at" {
				want = append(want, h)
			}
		}
		if len(m.Headers) != len(want)+4 {
			t.Errorf("%s: %d headers republished, want %d + 4", c.name, len(m.Headers), len(want))
			continue
		}
		for i, h := range want {
			if !bytes.Equal(m.Headers[i].Key, h.Key) || !bytes.Equal(m.Headers[i].Value, h.Value) {
				t.Errorf("%s: header %d = %q=%q, want %q=%q", c.name, i, m.Headers[i].Key, m.Headers[i].Value, h.Key, h.Value)
				break
			}
		}
		var added []string
		for _, h := range m.Headers[len(want):] {
			added = append(added, string(h.Key))
		}
		if !slices.Equal(added, []string{"defer.id", "defer.seq", "defer.attempt", "defer.scheduled-at"}) || hdr(m, "defer.attempt") != "1" {
			t.Errorf("%s: headers set by the scheduler %q (defer.attempt %q)", c.name, added, hdr(m, "defer.attempt"))
		}
	}
	seen := map[string]bool{}
	for _, m := range got["flood"] {
		seen[string(m.Value)] = true
	}
	if len(seen) != goodFlood {
		t.Errorf("%d distinct valid flood records republished, want %d", len(seen), goodFlood)
	}

	// What is stored.
	waitRows(t, db.Pool, 30*time.Second, "SELECT count(*) FROM deferred_message WHERE 'flood-bad' = ANY(header_keys)", badFlood)
	var wrong int
	if err := db.Pool.QueryRow(ctx, `
		SELECT count(*) FROM deferred_message
		WHERE 'flood-bad' = ANY(header_keys)
		  AND (state <> 'rejected' OR split_part(reason, ':', 1) <> (ARRAY['missing_target', 'invalid_delay', 'target_not_allowed'])[
		        convert_from(header_values[array_position(header_keys, 'n')], 'UTF8')::int % 3 + 1])`).Scan(&wrong); err != nil {
		t.Fatal(err)
	}
	if wrong != 0 {
		t.Errorf("%d flood rejects stored with the wrong state or reason", wrong)
	}

	// Rows that stay: wait until the parked ones are parked, then compare.
	waitRows(t, db.Pool, 30*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'parked'", 2)
	for _, c := range cases {
		if c.state == "delivered" {
			continue
		}
		var (
			state, reason string
			bizKey        *string
			key, value    []byte
			keys          []string
			values        [][]byte
			runAt         time.Time
		)
		err := db.Pool.QueryRow(ctx, `
			SELECT state, coalesce(reason, ''), business_key, key, value, header_keys, header_values, next_run_at
			FROM deferred_message
			WHERE header_values[array_position(header_keys, 'case')] = $1`, []byte(c.name)).
			Scan(&state, &reason, &bizKey, &key, &value, &keys, &values, &runAt)
		if err != nil {
			t.Errorf("%s: stored row: %v", c.name, err)
			continue
		}
		if state != c.state || !strings.HasPrefix(reason, c.reason) {
			t.Errorf("%s: stored %s %q, want %s %q...", c.name, state, reason, c.state, c.reason)
		}
		checkBytes(t, c.name+": stored key", key, c.key)
		checkBytes(t, c.name+": stored value", value, c.value)
		if len(keys) != len(c.headers) {
			t.Errorf("%s: %d headers stored, want %d", c.name, len(keys), len(c.headers))
		} else {
			for i, h := range c.headers {
				if keys[i] != string(h.Key) || !bytes.Equal(values[i], h.Value) {
					t.Errorf("%s: stored header %d = %q=%q, want %q=%q", c.name, i, keys[i], values[i], h.Key, h.Value)
					break
				}
			}
		}
		if c.state == "rejected" {
			continue
		}
		if (bizKey == nil) != (c.bizKey == nil) || bizKey != nil && *bizKey != *c.bizKey {
			t.Errorf("%s: business key %v, want %v", c.name, quoteOrNil(bizKey), quoteOrNil(c.bizKey))
		}
		if !c.runAt.IsZero() && !runAt.Equal(c.runAt) {
			t.Errorf("%s: next_run_at %v, want %v", c.name, runAt.UTC(), c.runAt.UTC())
		}
	}

	// The parked record too large for its target holds its key: the one
	// behind it waits.
	var held bool
	var headID int64
	if err := db.Pool.QueryRow(ctx, `
		SELECT k.held, k.head_id FROM deferred_key k WHERE k.business_key = 'small-1'`).Scan(&held, &headID); err != nil {
		t.Fatalf("head of small-1: %v", err)
	}
	var headState string
	if err := db.Pool.QueryRow(ctx, "SELECT state FROM deferred_message WHERE id = $1", headID).Scan(&headState); err != nil {
		t.Fatal(err)
	}
	if !held || headState != "parked" {
		t.Errorf("head of small-1: held %v, head %d %s; want held by the parked record", held, headID, headState)
	}

	// Ingest kept flowing: every partition read to its end.
	deadline = time.Now().Add(20 * time.Second)
	for p := range 4 {
		for {
			lag, ok := scrapeMetrics(t, svc).value(metrics.IngestLag, "partition", strconv.Itoa(p))
			if ok && lag == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("ingest lag of partition %d = %v (present %v), want 0", p, lag, ok)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

func quoteOrNil(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return strconv.Quote(*s)
}

// checkBytes compares b with want, nil (absent) and empty being different.
func checkBytes(t *testing.T, what string, b, want []byte) {
	t.Helper()
	if (b == nil) != (want == nil) {
		t.Errorf("%s: nil %v, want nil %v", what, b == nil, want == nil)
	} else if !bytes.Equal(b, want) {
		t.Errorf("%s: %d bytes differ from the %d sent", what, len(b), len(want))
	}
}

// largeProducer is a producer whose records may be up to 4 MiB, with the
// given partitioner (nil: murmur2, as the Java client).
func largeProducer(t *testing.T, brokers string, partitioner sarama.PartitionerConstructor) sarama.SyncProducer {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	c.Producer.Return.Successes = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Partitioner = sarama.NewMurmur2Partitioner
	if partitioner != nil {
		c.Producer.Partitioner = partitioner
	}
	c.Producer.MaxMessageBytes = 4 << 20
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer([]string{brokers}, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// kcatProduce produces c with kcat: its headers with -H, and its key and
// value on stdin, split by -K (kcat sends no record for an empty line, but
// with -Z an empty value after the key delimiter is a NULL value).
func kcatProduce(t *testing.T, kc, brokers string, c badCase) {
	t.Helper()
	args := []string{"-b", brokers, "-P", "-t", deferTopic, "-K", "\t"}
	if c.value == nil {
		args = append(args, "-Z")
	}
	for _, h := range c.headers {
		args = append(args, "-H", string(h.Key)+"="+string(h.Value))
	}
	cmd := exec.Command(kc, args...)
	cmd.Stdin = strings.NewReader(string(c.key) + "\t" + string(c.value) + "\n")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: kcat produce: %v\n%s", c.name, err, out)
	}
}
