package keygate_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/deferclient"
	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/keygate"
	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/runner"
	"github.com/deferq/scheduler/sql/queries"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const topic = "scheduler.defer"

// now is the server's clock in these tests.
var now = time.Unix(1_700_000_000, 0)

// billingKey signs the requests of the source "billing".
var billingKey = bytes.Repeat([]byte{0x2a}, protocol.MinKeyBytes)

// fakeOffsets answers with fixed marks and counts the questions, so that a
// test can tell a refused request never reached Kafka.
type fakeOffsets struct {
	mu     sync.Mutex
	marks  map[int32]int64
	starts map[int32]int64
	err    error
	delay  time.Duration
	calls  atomic.Int64
}

func (f *fakeOffsets) HighWaterMarks(string) (map[int32]int64, error) {
	f.calls.Add(1)
	time.Sleep(f.delay)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	out := map[int32]int64{}
	for p, m := range f.marks {
		out[p] = m
	}
	return out, nil
}

func (f *fakeOffsets) LogStart(_ string, p int32) (int64, error) {
	f.calls.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.starts[p], nil
}

// env is a server under test with what it was given.
type env struct {
	srv     *keygate.Server
	db      pgtest.DB
	offsets *fakeOffsets
	reg     *prometheus.Registry
}

// newEnv returns a server on a fresh database whose defer topic has one
// empty partition, with signing keys keys (none: open).
func newEnv(t *testing.T, keys map[string][]byte) *env {
	t.Helper()
	e := &env{db: pgtest.NewDB(t), offsets: &fakeOffsets{marks: map[int32]int64{0: 0}}, reg: prometheus.NewRegistry()}
	e.srv = keygate.NewServer(keygate.Config{DB: e.db.Pool, Offsets: e.offsets, Topic: topic, Keys: keys,
		Metrics: metrics.New(e.reg, "test"), Logger: testLogger(t), Now: func() time.Time { return now }})
	return e
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// answer is what the server said.
type answer struct {
	status int
	resp   keystate.Response
	err    string
	header http.Header
}

// do sends body to h with method, Content-Type and extra headers. It may
// run outside the test's goroutine, so it never stops the test.
func do(t *testing.T, h http.Handler, method, contentType string, body []byte, headers map[string]string) answer {
	t.Helper()
	r := httptest.NewRequest(method, keystate.Path, bytes.NewReader(body))
	if contentType != "" {
		r.Header.Set("Content-Type", contentType)
	}
	for k, v := range headers {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	a := answer{status: w.Code, header: w.Header()}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("answer's Content-Type %q, want application/json", ct)
	}
	if w.Code == http.StatusOK {
		dec := json.NewDecoder(w.Body)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&a.resp); err != nil {
			t.Errorf("200 with a body that is not a Response: %v", err)
		}
		return a
	}
	var e keystate.ErrorResponse
	if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error == "" {
		t.Errorf("%d with a body that is not an ErrorResponse: %q (%v)", w.Code, w.Body.String(), err)
	}
	a.err = e.Error
	return a
}

// post sends a request as the client does, unsigned.
func post(t *testing.T, h http.Handler, req keystate.Request) answer {
	t.Helper()
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return do(t, h, http.MethodPost, "application/json", body, nil)
}

// signed returns the authentication headers of body from source, signed
// with key at ts.
func signed(source string, key []byte, ts int64, body []byte) map[string]string {
	return map[string]string{
		keystate.HeaderSource:    source,
		keystate.HeaderTimestamp: strconv.FormatInt(ts, 10),
		keystate.HeaderSignature: keystate.Sign(key, ts, body),
	}
}

// digest sums every row of the tables a request could touch, to show it
// touched none.
func digest(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var out []string
	for _, table := range []string{"deferred_message", "deferred_key", "deferred_attempt", "deferred_inflight", "ingest_offset", "target_control"} {
		var sum string
		err := pool.QueryRow(context.Background(),
			fmt.Sprintf("SELECT count(*) || ':' || coalesce(md5(string_agg(t::text, ',' ORDER BY t::text)), '') FROM %s t", table)).Scan(&sum)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, table+"="+sum)
	}
	return strings.Join(out, " ")
}

// requests returns scheduler_key_state_requests_total{result}.
func requests(t *testing.T, reg *prometheus.Registry, result string) float64 {
	t.Helper()
	return metricValue(t, reg, metrics.KeyStateRequests, "result", result)
}

func metricValue(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestRefusals sends every kind of bad request and expects its status and
// exact error, nothing asked of Kafka and nothing changed in the database.
func TestRefusals(t *testing.T) {
	e := newEnv(t, nil)
	fixture.Insert(t, e.db.Pool, fixture.Message{Key: fixture.Key("order-1"), Target: "orders.created", In: time.Hour})
	before := digest(t, e.db.Pool)

	keys := func(n int) string {
		ks := make([]string, n)
		for i := range ks {
			ks[i] = fmt.Sprintf("%q", fmt.Sprintf("k%d", i))
		}
		return strings.Join(ks, ",")
	}
	big := `{"group":"g","keys":["` + strings.Repeat("x", keystate.MaxBodyBytes) + `"]}`
	tests := []struct {
		name        string
		method      string
		contentType string
		body        string
		status      int
		want        string
	}{
		{"GET", http.MethodGet, "application/json", `{"group":"g","keys":["a"]}`, 405,
			"method GET is not allowed: the key-state query is POST /v1/key-state with a JSON body"},
		{"PUT", http.MethodPut, "application/json", `{"group":"g","keys":["a"]}`, 405,
			"method PUT is not allowed: the key-state query is POST /v1/key-state with a JSON body"},
		{"no Content-Type", http.MethodPost, "", `{"group":"g","keys":["a"]}`, 415,
			`Content-Type "" is not application/json`},
		{"text/plain", http.MethodPost, "text/plain", `{"group":"g","keys":["a"]}`, 415,
			`Content-Type "text/plain" is not application/json`},
		{"body too large", http.MethodPost, "application/json", big, 413,
			fmt.Sprintf("the body is %d bytes, at most %d", len(big), keystate.MaxBodyBytes)},
		{"not JSON", http.MethodPost, "application/json", `group=g`, 400,
			"the body is not a key-state request: invalid character 'g' looking for beginning of value"},
		{"truncated", http.MethodPost, "application/json", `{"group":"g","keys":[`, 400,
			"the body is not a key-state request: unexpected EOF"},
		{"unknown field", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"grup":"g"}`, 400,
			`the body is not a key-state request: json: unknown field "grup"`},
		{"keys not a list", http.MethodPost, "application/json", `{"group":"g","keys":"a"}`, 400,
			"the body is not a key-state request: json: cannot unmarshal string into Go struct field Request.keys of type []string"},
		{"two values", http.MethodPost, "application/json", `{"group":"g","keys":["a"]} {}`, 400,
			"the body holds more than one JSON value"},
		{"no group", http.MethodPost, "application/json", `{"keys":["a"]}`, 400,
			"group is empty: name the consumer group the keys are asked for"},
		{"group too long", http.MethodPost, "application/json", `{"group":"` + strings.Repeat("g", 256) + `","keys":["a"]}`, 400,
			"group is 256 bytes, at most 255"},
		{"group not UTF-8", http.MethodPost, "application/json", "{\"group\":\"g\xff\",\"keys\":[\"a\"]}", 400,
			"group is not valid UTF-8"},
		{"no keys", http.MethodPost, "application/json", `{"group":"g"}`, 400,
			"keys is empty: ask about at least one business key"},
		{"empty keys", http.MethodPost, "application/json", `{"group":"g","keys":[]}`, 400,
			"keys is empty: ask about at least one business key"},
		{"too many keys", http.MethodPost, "application/json", `{"group":"g","keys":[` + keys(keystate.MaxKeys+1) + `]}`, 400,
			"keys holds 1001 keys, at most 1000 per request"},
		{"an empty key", http.MethodPost, "application/json", `{"group":"g","keys":["a",""]}`, 400,
			"keys[1] is empty"},
		{"a key too long", http.MethodPost, "application/json", `{"group":"g","keys":["a","b","` + strings.Repeat("k", keystate.MaxKeyBytes+1) + `"]}`, 400,
			"keys[2] is 1025 bytes, at most 1024"},
		{"a key not UTF-8", http.MethodPost, "application/json", "{\"group\":\"g\",\"keys\":[\"a\",\"b\xc3\"]}", 400,
			"keys[1] is not valid UTF-8"},
		{"a lone high surrogate", http.MethodPost, "application/json", `{"group":"g","keys":["\ud800x"]}`, 400,
			"keys[0] is not valid UTF-8"},
		{"a lone low surrogate", http.MethodPost, "application/json", `{"group":"g","keys":["a","b","\\\udc00"]}`, 400,
			"keys[2] is not valid UTF-8"},
		{"a high surrogate at the end", http.MethodPost, "application/json", `{"group":"g","keys":["a\uD83D"]}`, 400,
			"keys[0] is not valid UTF-8"},
		{"negative wait", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait_ms":-1}`, 400,
			"wait_ms is -1; want 0 (the server's default) to 10000"},
		{"wait too long", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait_ms":10001}`, 400,
			"wait_ms is 10001; want 0 (the server's default) to 10000"},
		{"wait not an integer", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait_ms":1.5}`, 400,
			"the body is not a key-state request: json: cannot unmarshal number 1.5 into Go struct field Request.wait_ms of type int"},
		{"an unknown wait", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait":"some"}`, 400,
			`wait is "some"; want "all" (the default) or "positions"`},
		{"positions without wait positions", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"positions":{"0":5}}`, 400,
			`positions are given with wait ""; they go with wait "positions"`},
		{"positions with wait all", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait":"all","positions":{"0":5}}`, 400,
			`positions are given with wait "all"; they go with wait "positions"`},
		{"a negative offset", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait":"positions","positions":{"0":5,"2":-1}}`, 400,
			"positions[2] is -1: want a partition and an offset of 0 or more"},
		{"a negative partition", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait":"positions","positions":{"-3":5}}`, 400,
			"positions[-3] is 5: want a partition and an offset of 0 or more"},
		{"a partition not a number", http.MethodPost, "application/json", `{"group":"g","keys":["a"],"wait":"positions","positions":{"x":5}}`, 400,
			"the body is not a key-state request: json: cannot unmarshal number x into Go struct field Request.positions of type int32"},
	}
	refused := 0.0
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := do(t, e.srv, tt.method, tt.contentType, []byte(tt.body), nil)
			if got.status != tt.status || got.err != tt.want {
				t.Errorf("got %d %q\nwant %d %q", got.status, got.err, tt.status, tt.want)
			}
			if tt.status == 405 && got.header.Get("Allow") != "POST" {
				t.Errorf("405 with Allow %q, want POST", got.header.Get("Allow"))
			}
			refused++
			if n := requests(t, e.reg, "refused"); n != refused {
				t.Errorf("refused counter %v, want %v", n, refused)
			}
		})
	}

	// A body of unknown length (chunked) is cut at the limit too.
	t.Run("body too large, chunked", func(t *testing.T) {
		r := httptest.NewRequest(http.MethodPost, keystate.Path, io.MultiReader(strings.NewReader(big)))
		r.ContentLength = -1
		r.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		e.srv.ServeHTTP(w, r)
		if want := fmt.Sprintf(`{"error":"the body is over %d bytes"}`+"\n", keystate.MaxBodyBytes); w.Code != 413 || w.Body.String() != want {
			t.Errorf("got %d %s, want 413 %s", w.Code, w.Body.String(), want)
		}
	})

	if n := e.offsets.calls.Load(); n != 0 {
		t.Errorf("refused requests asked Kafka %d times", n)
	}
	if after := digest(t, e.db.Pool); after != before {
		t.Errorf("refused requests changed the database:\nbefore %s\nafter  %s", before, after)
	}
	if n := requests(t, e.reg, "answered") + requests(t, e.reg, "unsure"); n != 0 {
		t.Errorf("%v refused requests counted as answered or unsure", n)
	}

	// What the refusals are not: a charset parameter, a key of exactly the
	// limits, a surrogate pair, the limits of wait_ms.
	for _, body := range []string{
		`{"group":"` + strings.Repeat("g", 255) + `","keys":["` + strings.Repeat("k", keystate.MaxKeyBytes) + `"]}`,
		`{"group":"g","keys":["\ud83d\ude00", "\\ud800", "ü"],"wait_ms":10000}`,
		`{"group":"g","keys":[` + keys(keystate.MaxKeys) + `],"wait_ms":0}`,
	} {
		if got := do(t, e.srv, http.MethodPost, "application/json; charset=utf-8", []byte(body), nil); got.status != 200 {
			t.Errorf("%.80s: got %d %q, want 200", body, got.status, got.err)
		}
	}
}

// TestAuthentication: with signing keys, only a request signed by a known
// source, recently, over its very body, is answered; without, any is.
func TestAuthentication(t *testing.T) {
	e := newEnv(t, map[string][]byte{"billing": billingKey})
	body := []byte(`{"group":"g","keys":["order-1"]}`)
	ts := now.Unix()
	with := func(change func(h map[string]string)) map[string]string {
		h := signed("billing", billingKey, ts, body)
		change(h)
		return h
	}
	other := bytes.Repeat([]byte{0x2b}, protocol.MinKeyBytes)
	tests := []struct {
		name    string
		headers map[string]string
		want    string // "" for 200
	}{
		{"signed", signed("billing", billingKey, ts, body), ""},
		{"signed at the limit of the skew", signed("billing", billingKey, ts-keystate.MaxClockSkew, body), ""},
		{"no headers", nil,
			"X-Defer-Source is missing: this scheduler answers signed key-state requests only (SIGNING_KEYS)"},
		{"unknown source", signed("shipping", billingKey, ts, body),
			`X-Defer-Source "shipping" has no signing key here (SIGNING_KEYS)`},
		{"not a source name", with(func(h map[string]string) { h[keystate.HeaderSource] = "bill ing" }),
			"X-Defer-Source is not a source name (1 to 128 of [A-Za-z0-9._-])"},
		{"no timestamp", with(func(h map[string]string) { delete(h, keystate.HeaderTimestamp) }),
			"X-Defer-Timestamp is missing"},
		{"timestamp not a number", with(func(h map[string]string) { h[keystate.HeaderTimestamp] = "yesterday" }),
			"X-Defer-Timestamp is not Unix seconds"},
		{"stale", signed("billing", billingKey, ts-keystate.MaxClockSkew-1, body),
			"X-Defer-Timestamp 1699999699 is 301s behind the server's clock (1700000000); at most 300s either way: check the clocks, or the request is a replay"},
		{"from the future", signed("billing", billingKey, ts+3600, body),
			"X-Defer-Timestamp 1700003600 is 3600s ahead of the server's clock (1700000000); at most 300s either way: check the clocks, or the request is a replay"},
		{"far past", with(func(h map[string]string) { h[keystate.HeaderTimestamp] = "-9223372036854775808" }),
			"X-Defer-Timestamp -9223372036854775808 is 9223372038554775808s behind the server's clock (1700000000); at most 300s either way: check the clocks, or the request is a replay"},
		{"no signature", with(func(h map[string]string) { delete(h, keystate.HeaderSignature) }),
			"X-Defer-Signature is missing"},
		{"another key", signed("billing", other, ts, body),
			`X-Defer-Signature does not verify under the key of source "billing": signed with another key, or over another body or timestamp`},
		{"another body", signed("billing", billingKey, ts, []byte(`{"group":"g","keys":["order-2"]}`)),
			`X-Defer-Signature does not verify under the key of source "billing": signed with another key, or over another body or timestamp`},
		{"another timestamp", with(func(h map[string]string) { h[keystate.HeaderTimestamp] = strconv.FormatInt(ts-1, 10) }),
			`X-Defer-Signature does not verify under the key of source "billing": signed with another key, or over another body or timestamp`},
		{"not hex", with(func(h map[string]string) { h[keystate.HeaderSignature] = strings.Repeat("z", 64) }),
			`X-Defer-Signature does not verify under the key of source "billing": signed with another key, or over another body or timestamp`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			calls := e.offsets.calls.Load()
			got := do(t, e.srv, http.MethodPost, "application/json", body, tt.headers)
			switch {
			case tt.want == "" && got.status != 200:
				t.Errorf("got %d %q, want 200", got.status, got.err)
			case tt.want != "" && (got.status != 401 || got.err != tt.want):
				t.Errorf("got %d %q\nwant 401 %q", got.status, got.err, tt.want)
			case tt.want != "" && e.offsets.calls.Load() != calls:
				t.Errorf("an unauthenticated request asked Kafka")
			}
		})
	}

	// Authentication comes first: an unsigned bad request learns nothing
	// of what is wrong with it.
	if got := do(t, e.srv, http.MethodPost, "application/json", []byte(`{"keys":[]}`), nil); got.status != 401 {
		t.Errorf("unsigned bad request: got %d %q, want 401", got.status, got.err)
	}

	// Without signing keys the query is open.
	open := newEnv(t, map[string][]byte{"billing": nil})
	if got := do(t, open.srv, http.MethodPost, "application/json", body, nil); got.status != 200 {
		t.Errorf("no signing keys, unsigned: got %d %q, want 200", got.status, got.err)
	}
}

// setGroup sets the consumer group of messages, as ingest stores
// defer.group.
func setGroup(t *testing.T, pool *pgxpool.Pool, group string, ids ...int64) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), "UPDATE deferred_message SET group_id = $1 WHERE id = ANY($2)", group, ids); err != nil {
		t.Fatal(err)
	}
}

// keyMessage is m as a message of business key key, due in an hour, to
// orders.created unless it names a target or is rejected.
func keyMessage(key string, m fixture.Message) fixture.Message {
	m.Key = fixture.Key(key)
	if m.Target == "" && m.State != "rejected" {
		m.Target = "orders.created"
	}
	m.In = time.Hour
	return m
}

// TestKeyStates answers for keys in every state, for one group, in the
// order asked, a key asked twice answered twice.
func TestKeyStates(t *testing.T) {
	e := newEnv(t, nil)
	pool := e.db.Pool
	msg := keyMessage
	ids := fixture.Insert(t, pool,
		msg("pending", fixture.Message{}),
		msg("pending", fixture.Message{}),
		msg("parked-holds", fixture.Message{State: "parked", Reason: "max_attempts: 3"}),
		msg("parked-releases", fixture.Message{State: "parked", Reason: "max_attempts: 3", Release: true}),
		msg("rejected", fixture.Message{State: "rejected", Reason: "no_target: defer.target is absent"}),
		msg("other-group", fixture.Message{}),
		msg("no-group", fixture.Message{}),
		msg("parked-then-pending", fixture.Message{Seq: 5, State: "parked", Reason: "max_attempts: 3"}),
		msg("parked-then-pending", fixture.Message{Seq: 6}),
	)
	setGroup(t, pool, "payments", ids[0], ids[1], ids[2], ids[3], ids[4], ids[7], ids[8])
	setGroup(t, pool, "shipping", ids[5])
	if _, err := pool.Exec(context.Background(), `
		INSERT INTO deferred_inflight (group_id, business_key, target_topic, partition, record_offset, message_id, seq)
		VALUES ('payments', 'in-flight', 'orders.created', 0, 17, 999, 3),
		       ('shipping', 'pending', 'orders.created', 1, 4, 998, 1)`); err != nil {
		t.Fatal(err)
	}
	seqOf := func(id int64) int64 {
		var seq int64
		if err := pool.QueryRow(context.Background(), "SELECT seq FROM deferred_message WHERE id = $1", id).Scan(&seq); err != nil {
			t.Fatal(err)
		}
		return seq
	}
	before := digest(t, pool)

	got := post(t, e.srv, keystate.Request{Group: "payments", Keys: []string{
		"unknown", "pending", "parked-holds", "parked-releases", "rejected", "in-flight", "other-group", "no-group",
		"parked-then-pending", "pending",
	}})
	want := keystate.Response{Keys: []keystate.State{
		{Key: "unknown"},
		{Key: "pending", Blocked: true, Reason: keystate.ReasonPending, HeadSeq: seqOf(ids[0]), HeadID: ids[0]},
		{Key: "parked-holds", Blocked: true, Reason: keystate.ReasonParked, HeadSeq: seqOf(ids[2]), HeadID: ids[2]},
		{Key: "parked-releases"},
		{Key: "rejected", Blocked: true, Reason: "rejected", HeadSeq: seqOf(ids[4]), HeadID: ids[4]},
		{Key: "in-flight", Blocked: true, Reason: keystate.ReasonInFlight},
		{Key: "other-group"},
		{Key: "no-group"},
		{Key: "parked-then-pending", Blocked: true, Reason: keystate.ReasonParked, HeadSeq: 5, HeadID: ids[7]},
		{Key: "pending", Blocked: true, Reason: keystate.ReasonPending, HeadSeq: seqOf(ids[0]), HeadID: ids[0]},
	}}
	if got.status != 200 {
		t.Fatalf("got %d %q, want 200", got.status, got.err)
	}
	if fmt.Sprint(got.resp.Keys) != fmt.Sprint(want.Keys) {
		t.Errorf("answer\n%+v\nwant\n%+v", got.resp, want)
	}
	// The other group sees its own keys only.
	got = post(t, e.srv, keystate.Request{Group: "shipping", Keys: []string{"other-group", "pending", "in-flight"}})
	want = keystate.Response{Keys: []keystate.State{
		{Key: "other-group", Blocked: true, Reason: keystate.ReasonPending, HeadSeq: seqOf(ids[5]), HeadID: ids[5]},
		{Key: "pending", Blocked: true, Reason: keystate.ReasonInFlight},
		{Key: "in-flight"},
	}}
	if got.status != 200 || fmt.Sprint(got.resp.Keys) != fmt.Sprint(want.Keys) {
		t.Errorf("shipping: got %d %q %+v\nwant %+v", got.status, got.err, got.resp, want)
	}

	if n := requests(t, e.reg, "answered"); n != 2 {
		t.Errorf("answered counter %v, want 2", n)
	}
	blocked := metricValue(t, e.reg, metrics.KeyStateKeys, "answer", "blocked")
	free := metricValue(t, e.reg, metrics.KeyStateKeys, "answer", "free")
	if blocked != 6+2 || free != 4+1 {
		t.Errorf("keys counted blocked %v, free %v; want 8 and 5", blocked, free)
	}
	if after := digest(t, pool); after != before {
		t.Errorf("answering changed the database:\nbefore %s\nafter  %s", before, after)
	}
}

// setPosition stores an ingest position, as ingest does.
func setPosition(t *testing.T, pool *pgxpool.Pool, partition int32, next int64) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
		INSERT INTO ingest_offset (topic, partition, next_offset) VALUES ($1, $2, $3)
		ON CONFLICT (topic, partition) DO UPDATE SET next_offset = excluded.next_offset`, topic, partition, next)
	if err != nil {
		t.Fatal(err)
	}
}

// TestWaitsForIngest: the answer waits until every partition's stored
// ingest position reaches the high-water mark read when the request came
// in, says it cannot vouch past the wait, and answers once ingest caught
// up.
func TestWaitsForIngest(t *testing.T) {
	e := newEnv(t, nil)
	pool := e.db.Pool
	e.offsets.marks = map[int32]int64{0: 0, 1: 10, 2: 55, 3: 7}
	e.offsets.starts = map[int32]int64{3: 7}
	setPosition(t, pool, 1, 10)
	setPosition(t, pool, 2, 40)
	req := keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 300}

	start := time.Now()
	got := post(t, e.srv, req)
	took := time.Since(start)
	if want := "ingest has stored scheduler.defer/2 up to offset 40, the high-water mark is 55; not caught up within 300ms"; got.status != 503 || got.err != want {
		t.Errorf("lagging: got %d %q\nwant 503 %q", got.status, got.err, want)
	}
	if took < 300*time.Millisecond || took > 3*time.Second {
		t.Errorf("the unsure answer took %v, want the wait of 300ms", took)
	}
	if n := requests(t, e.reg, "unsure"); n != 1 {
		t.Errorf("unsure counter %v, want 1", n)
	}

	// Partition 3 has no position: caught up only while its log start is
	// its high-water mark; partition 2 stays behind too.
	e.offsets.mu.Lock()
	e.offsets.starts[3] = 2
	e.offsets.mu.Unlock()
	got = post(t, e.srv, keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 50})
	if want := "ingest has stored scheduler.defer/2 up to offset 40, the high-water mark is 55 (and 1 more partition behind); not caught up within 50ms"; got.status != 503 || got.err != want {
		t.Errorf("two lagging: got %d %q\nwant 503 %q", got.status, got.err, want)
	}
	setPosition(t, pool, 2, 55)
	got = post(t, e.srv, keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 50})
	if want := "ingest has stored nothing of scheduler.defer/3, which holds offsets 2 to 6 (high-water mark 7); not caught up within 50ms"; got.status != 503 || got.err != want {
		t.Errorf("never ingested: got %d %q\nwant 503 %q", got.status, got.err, want)
	}
	e.offsets.mu.Lock()
	e.offsets.starts[3] = 7
	e.offsets.mu.Unlock()
	setPosition(t, pool, 2, 40)

	// Ingest stores the record and moves the position while the request
	// waits: the request sees the record.
	done := make(chan answer, 1)
	start = time.Now()
	go func() {
		done <- post(t, e.srv, keystate.Request{Group: "payments", Keys: []string{"order-1", "order-2"}, WaitMillis: 10_000})
	}()
	time.Sleep(200 * time.Millisecond)
	select {
	case got := <-done:
		t.Fatalf("answered %d %q %+v before ingest caught up", got.status, got.err, got.resp)
	default:
	}
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var id, seq int64
	if err := tx.QueryRow(context.Background(), `
		INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at, header_keys, header_values, group_id,
			source_topic, source_partition, source_epoch, source_offset)
		VALUES ('order-1', nextval('deferred_message_seq'), 'orders.created', now() + interval '1 hour', '{}', '{}', 'payments', $1, 2, 0, 54)
		RETURNING id, seq`, topic).Scan(&id, &seq); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), "UPDATE ingest_offset SET next_offset = 55 WHERE topic = $1 AND partition = 2", topic); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	got = <-done
	want := keystate.Response{Keys: []keystate.State{
		{Key: "order-1", Blocked: true, Reason: keystate.ReasonPending, HeadSeq: seq, HeadID: id},
		{Key: "order-2"},
	}}
	if got.status != 200 || fmt.Sprint(got.resp.Keys) != fmt.Sprint(want.Keys) {
		t.Errorf("after ingest caught up: got %d %q %+v\nwant 200 %+v", got.status, got.err, got.resp, want)
	}
	if took := time.Since(start); took < 200*time.Millisecond || took > 5*time.Second {
		t.Errorf("answered after %v, want soon after ingest caught up at 200ms", took)
	}
}

// failingDB fails every statement, as a database that went away.
type failingDB struct{}

var errDBDown = errors.New("connection refused")

func (failingDB) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errDBDown
}
func (failingDB) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, errDBDown }
func (failingDB) QueryRow(context.Context, string, ...any) pgx.Row        { return nil }

var _ queries.DBTX = failingDB{}

// TestUnsure: when Kafka or the database cannot answer, or Kafka is not
// connected yet, the server says exactly that with 503.
func TestUnsure(t *testing.T) {
	db := pgtest.NewDB(t)
	req := keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 200}
	tests := []struct {
		name    string
		db      queries.DBTX
		offsets keygate.Offsets
		want    string
	}{
		{"kafka connecting", db.Pool, nil,
			"kafka: connecting; the high-water marks of scheduler.defer cannot be read yet"},
		{"kafka fails", db.Pool, &fakeOffsets{err: errors.New("kafka: client has run out of available brokers to talk to")},
			"kafka: reading the high-water marks of scheduler.defer: kafka: client has run out of available brokers to talk to"},
		{"kafka slow", db.Pool, &fakeOffsets{marks: map[int32]int64{0: 0}, delay: time.Second},
			"kafka: reading the high-water marks of scheduler.defer: no answer within 200ms"},
		{"database fails", failingDB{}, &fakeOffsets{marks: map[int32]int64{0: 3}},
			"database: reading the ingest positions of scheduler.defer: connection refused"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			srv := keygate.NewServer(keygate.Config{DB: tt.db, Offsets: tt.offsets, Topic: topic,
				Metrics: metrics.New(reg, "test"), Logger: testLogger(t)})
			start := time.Now()
			got := post(t, srv, req)
			if got.status != 503 || got.err != tt.want {
				t.Errorf("got %d %q\nwant 503 %q", got.status, got.err, tt.want)
			}
			if took := time.Since(start); took > 900*time.Millisecond {
				t.Errorf("took %v, past the wait of 200ms", took)
			}
			if n := requests(t, reg, "unsure"); n != 1 {
				t.Errorf("unsure counter %v, want 1", n)
			}
		})
	}

	// Kafka connects later: the same server answers.
	srv := keygate.NewServer(keygate.Config{DB: db.Pool, Topic: topic, Logger: testLogger(t)})
	if got := post(t, srv, req); got.status != 503 {
		t.Fatalf("before SetOffsets: got %d, want 503", got.status)
	}
	srv.SetOffsets(&fakeOffsets{marks: map[int32]int64{0: 0}})
	if got := post(t, srv, req); got.status != 200 {
		t.Errorf("after SetOffsets: got %d %q, want 200", got.status, got.err)
	}
}

// kafkaEnv is an in-process broker holding the defer topic, with a
// producer that picks partitions by hand.
type kafkaEnv struct {
	addr     string
	client   sarama.Client
	producer sarama.SyncProducer
}

func saramaConfig() *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	return c
}

func newKafka(t *testing.T, partitions int32) *kafkaEnv {
	t.Helper()
	k := &kafkaEnv{addr: kafkatest.Start(t, kafkatest.Broker{Topics: []string{topic}, Partitions: partitions})}
	var err error
	if k.client, err = sarama.NewClient([]string{k.addr}, saramaConfig()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.client.Close() })
	pc := saramaConfig()
	pc.Producer.Return.Successes = true
	pc.Producer.RequiredAcks = sarama.WaitForAll
	pc.Producer.Partitioner = sarama.NewManualPartitioner
	if k.producer, err = sarama.NewSyncProducer([]string{k.addr}, pc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.producer.Close() })
	return k
}

// deferRecord produces a deferral of business key for group to partition.
func (k *kafkaEnv) deferRecord(t *testing.T, partition int32, key, group string) {
	t.Helper()
	m := &sarama.ProducerMessage{Topic: topic, Partition: partition, Value: sarama.StringEncoder("v"), Headers: []sarama.RecordHeader{
		{Key: []byte(protocol.HeaderTarget), Value: []byte("orders.created")},
		{Key: []byte(protocol.HeaderDelay), Value: []byte("1h")},
		{Key: []byte(protocol.HeaderKey), Value: []byte(key)},
		{Key: []byte(protocol.HeaderGroup), Value: []byte(group)},
	}}
	if _, _, err := k.producer.SendMessage(m); err != nil {
		t.Fatal(err)
	}
}

// TestKafkaOffsets reads high-water marks and log starts from a real
// broker.
func TestKafkaOffsets(t *testing.T) {
	k := newKafka(t, 3)
	for range 3 {
		k.deferRecord(t, 1, "order-1", "payments")
	}
	k.deferRecord(t, 2, "order-2", "payments")
	o := keygate.KafkaOffsets{Client: k.client}
	marks, err := o.HighWaterMarks(topic)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(marks) != "map[0:0 1:3 2:1]" {
		t.Errorf("high-water marks %v, want map[0:0 1:3 2:1]", marks)
	}
	admin, err := sarama.NewClusterAdminFromClient(k.client)
	if err != nil {
		t.Fatal(err)
	}
	if err := admin.DeleteRecords(topic, map[int32]int64{1: 2}); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[int32]int64{0: 0, 1: 2, 2: 0} {
		if got, err := o.LogStart(topic, p); err != nil || got != want {
			t.Errorf("log start of %d: %d, %v; want %d", p, got, err, want)
		}
	}
	if _, err := o.HighWaterMarks("no.such.topic"); err == nil {
		t.Error("high-water marks of a topic that does not exist: no error")
	}
}

// startIngest runs the scheduler's ingest on the defer topic until the
// test ends, with FutureLinger future; it returns the ingester.
func startIngest(t *testing.T, k *kafkaEnv, pool *pgxpool.Pool, future time.Duration) *ingest.Ingester {
	t.Helper()
	consumer, err := ingest.NewConsumer([]string{k.addr}, "scheduler", saramaConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	in, err := ingest.NewIngester(consumer.Group, ingest.NewStore(pool, nil), ingest.IngestConfig{
		Topic: topic, Group: "scheduler", Log: consumer.Log(),
		Rules:     protocol.Rules{Targets: protocol.TargetPatterns{"orders.*"}, MaxDelay: 24 * time.Hour},
		BatchSize: 100, BatchLinger: 5 * time.Millisecond, FutureLinger: future,
	}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	// Registered first so that it runs last, after the ingester stopped.
	t.Cleanup(func() { consumer.Close() })
	runInBackground(t, in.Run)
	return in
}

// runInBackground runs run until the test ends, then stops it and waits
// for it to return (cleanups run last in, first out: one registered
// before this runs after run returned).
func runInBackground(t *testing.T, run func(context.Context)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// startFlushListener runs the service's notification listener with flush
// called on each ingest flush notification, until the test ends.
func startFlushListener(t *testing.T, pool *pgxpool.Pool, flush func()) {
	t.Helper()
	waker := runner.NewWaker(pool, 5*time.Millisecond, testLogger(t))
	waker.On(queries.IngestFlushChannel, flush)
	runInBackground(t, waker.Run)
}

// TestReadYourWrites goes through the real parts: records produced to the
// defer topic, the scheduler's ingest storing them, the server waiting for
// it, and deferclient asking.
func TestReadYourWrites(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t, 3)
	reg := prometheus.NewRegistry()
	srv := keygate.NewServer(keygate.Config{DB: db.Pool, Offsets: keygate.KafkaOffsets{Client: k.client}, Topic: topic,
		Keys: map[string][]byte{"billing": billingKey}, Metrics: metrics.New(reg, "test"), Logger: testLogger(t)})
	signedPost := func(req keystate.Request) answer {
		body, _ := json.Marshal(req)
		return do(t, srv, http.MethodPost, "application/json", body, signed("billing", billingKey, time.Now().Unix(), body))
	}

	// Nothing produced: nothing to wait for, every key free.
	got := signedPost(keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 100})
	if got.status != 200 || fmt.Sprint(got.resp.Keys) != "[{order-1 false  0 0}]" {
		t.Fatalf("empty topic: got %d %q %+v", got.status, got.err, got.resp)
	}

	// Produced, not ingested: the server cannot vouch for the key.
	k.deferRecord(t, 1, "order-1", "payments")
	got = signedPost(keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 300})
	if want := "ingest has stored nothing of scheduler.defer/1, which holds offsets 0 to 0 (high-water mark 1); not caught up within 300ms"; got.status != 503 || got.err != want {
		t.Fatalf("before ingest: got %d %q\nwant 503 %q", got.status, got.err, want)
	}

	// Asked to wait for nothing, as a consumer does once it had an answer
	// that waited for all: the answer comes at once, and Stored says it
	// does not cover the record, which the client that deferred it keeps
	// blocked itself.
	got = signedPost(keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 300, Wait: keystate.WaitPositions})
	if _, covered := got.resp.Stored[1]; got.status != 200 || fmt.Sprint(got.resp.Keys) != "[{order-1 false  0 0}]" || covered {
		t.Fatalf("waiting for nothing, before ingest: got %d %q %+v, want 200, free, nothing of partition 1 stored", got.status, got.err, got.resp)
	}
	// Asked to wait for that record alone: the server cannot vouch.
	got = signedPost(keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 300,
		Wait: keystate.WaitPositions, Positions: map[int32]int64{1: 1}})
	if want := "ingest has stored nothing of scheduler.defer/1, the request waits for 1; not caught up within 300ms"; got.status != 503 || got.err != want {
		t.Fatalf("waiting for the record, before ingest: got %d %q\nwant 503 %q", got.status, got.err, want)
	}

	// Ingest runs: the same question, with room to wait, is answered
	// blocked once the record is stored.
	startIngest(t, k, db.Pool, 0)
	got = signedPost(keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 10_000,
		Wait: keystate.WaitPositions, Positions: map[int32]int64{1: 1}})
	if got.status != 200 || len(got.resp.Keys) != 1 || !got.resp.Keys[0].Blocked || got.resp.Stored[1] < 1 {
		t.Fatalf("waiting for the record, after ingest: got %d %q %+v, want 200, blocked, partition 1 stored past offset 0", got.status, got.err, got.resp)
	}
	got = signedPost(keystate.Request{Group: "payments", Keys: []string{"order-1", "order-2"}, WaitMillis: 10_000})
	var id, seq int64
	if err := db.Pool.QueryRow(context.Background(), "SELECT id, seq FROM deferred_message WHERE business_key = 'order-1'").Scan(&id, &seq); err != nil {
		t.Fatalf("the record was not stored: %v (answer %d %q)", err, got.status, got.err)
	}
	want := keystate.Response{Keys: []keystate.State{
		{Key: "order-1", Blocked: true, Reason: keystate.ReasonPending, HeadSeq: seq, HeadID: id},
		{Key: "order-2"},
	}}
	if got.status != 200 || fmt.Sprint(got.resp.Keys) != fmt.Sprint(want.Keys) {
		t.Errorf("after ingest: got %d %q %+v\nwant 200 %+v", got.status, got.err, got.resp, want)
	}

	// deferclient's deferral, asked about at once: the answer must come
	// from the scheduler (the client forgets its own deferral once the
	// answer covers it), blocked.
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	c, err := deferclient.New(deferclient.Config{Brokers: []string{k.addr}, Group: "payments", SchedulerURL: hs.URL,
		Source: "billing", SourceKey: billingKey, KeyStateWait: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	failed := &sarama.ConsumerMessage{Topic: "orders", Key: []byte("order-3"), Value: []byte("v")}
	if err := c.Defer(context.Background(), failed, deferclient.Deferral{Target: "orders.created", BusinessKey: "order-3", Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	states, err := c.KeyStates(context.Background(), []string{"order-3", "order-4"})
	if err != nil {
		t.Fatal(err)
	}
	if s := states["order-3"]; !s.Blocked || s.Reason != deferclient.ReasonPending || s.HeadSeq == 0 {
		t.Errorf("order-3 deferred by the client: %+v, want blocked pending with its seq", s)
	}
	if s := states["order-4"]; s.Blocked {
		t.Errorf("order-4: %+v, want free", s)
	}
}

// TestAnswerDoesNotWaitOutTheFutureLinger checks that a question asked
// while ingest holds a deferral due far ahead (INGEST_FUTURE_LINGER) is
// answered once ingest stored it at the question's request, not when the
// linger ends: the server notifies queries.IngestFlushChannel, and the
// service's listener (runner.Waker) hands that to the ingester's Flush.
func TestAnswerDoesNotWaitOutTheFutureLinger(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t, 3)
	srv := keygate.NewServer(keygate.Config{DB: db.Pool, Offsets: keygate.KafkaOffsets{Client: k.client}, Topic: topic,
		Logger: testLogger(t)})
	in := startIngest(t, k, db.Pool, time.Minute)
	startFlushListener(t, db.Pool, in.Flush)

	// Ingest has joined and stores at once what falls due soon.
	waitStored := func(key string, within time.Duration) {
		t.Helper()
		deadline := time.Now().Add(within)
		for {
			var n int
			if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_message WHERE business_key = $1", key).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n == 1 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not stored within %v", key, within)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	soon := &sarama.ProducerMessage{Topic: topic, Partition: 1, Value: sarama.StringEncoder("v"), Headers: []sarama.RecordHeader{
		{Key: []byte(protocol.HeaderTarget), Value: []byte("orders.created")},
		{Key: []byte(protocol.HeaderDelay), Value: []byte("0s")},
		{Key: []byte(protocol.HeaderKey), Value: []byte("order-0")},
	}}
	if _, _, err := k.producer.SendMessage(soon); err != nil {
		t.Fatal(err)
	}
	waitStored("order-0", 30*time.Second)
	// The listener is up once a flush notification reaches it: a batch it
	// flushes goes at once.
	k.deferRecord(t, 1, "order-probe", "payments")
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := queries.IngestFlush(context.Background(), db.Pool); err != nil {
			t.Fatal(err)
		}
		var n int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_message WHERE business_key = 'order-probe'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("order-probe, due in an hour, not stored within 30s of flush notifications")
		}
		time.Sleep(50 * time.Millisecond)
	}

	// A deferral due in an hour lingers in its batch for a minute; the
	// question, with ten seconds to wait, gets its answer well before.
	// A flush notification of the probe's loop still on its way may take
	// a deferral with it: then another key, until one lingers.
	var key string
	for i := 1; key == ""; i++ {
		candidate := fmt.Sprintf("order-%d", i)
		k.deferRecord(t, 2, candidate, "payments")
		time.Sleep(200 * time.Millisecond)
		var n int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM deferred_message WHERE business_key = $1", candidate).Scan(&n); err != nil {
			t.Fatal(err)
		}
		switch {
		case n == 0:
			key = candidate
		case i == 5:
			t.Fatalf("%s stored before any question: no batch lingered in five tries, the test proves nothing", candidate)
		}
	}
	start := time.Now()
	got := post(t, srv, keystate.Request{Group: "payments", Keys: []string{key}, WaitMillis: 10_000})
	took := time.Since(start)
	if got.status != 200 || len(got.resp.Keys) != 1 || !got.resp.Keys[0].Blocked {
		t.Fatalf("got %d %q %+v after %v, want 200 with %s blocked", got.status, got.err, got.resp, took, key)
	}
	if took > 5*time.Second {
		t.Errorf("answered after %v: the question waited for the linger, not for a flush", took)
	}
	t.Logf("answered after %v", took)
}

// TestAnswerFlushesAgainWhileBehind checks that a key-state request asks
// ingest to write again at each poll that finds it behind, not once: a
// flush that came before the claim that reads the record started (here,
// before the process's ingest exists at all: a restart, a rebalance) leaves
// that record to linger, and the answer would wait its whole FutureLinger.
func TestAnswerFlushesAgainWhileBehind(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t, 3)
	srv := keygate.NewServer(keygate.Config{DB: db.Pool, Offsets: keygate.KafkaOffsets{Client: k.client}, Topic: topic,
		Logger: testLogger(t)})
	var (
		current atomic.Pointer[ingest.Ingester]
		flushes atomic.Int64
	)
	startFlushListener(t, db.Pool, func() {
		flushes.Add(1)
		if in := current.Load(); in != nil {
			in.Flush()
		}
	})
	waitFlushes := func(n int64) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for flushes.Load() < n {
			if time.Now().After(deadline) {
				t.Fatalf("%d flush notifications within 30s, want %d", flushes.Load(), n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// The listener is up once a notification reaches it.
	for deadline := time.Now().Add(30 * time.Second); flushes.Load() == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no flush notification reached the listener within 30s")
		}
		if err := queries.IngestFlush(context.Background(), db.Pool); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond) // the probe's last notifications arrive

	// A deferral due in an hour waits in the topic; no ingest runs yet.
	k.deferRecord(t, 1, "order-1", "payments")
	before := flushes.Load()
	type reply struct {
		got  answer
		took time.Duration
	}
	answered := make(chan reply, 1)
	start := time.Now()
	go func() {
		got := post(t, srv, keystate.Request{Group: "payments", Keys: []string{"order-1"}, WaitMillis: 10_000})
		answered <- reply{got, time.Since(start)}
	}()
	// The request's first flush reaches no ingest; then ingest starts, and
	// its batch would linger a minute.
	waitFlushes(before + 1)
	current.Store(startIngest(t, k, db.Pool, time.Minute))
	a := <-answered
	if a.got.status != 200 || len(a.got.resp.Keys) != 1 || !a.got.resp.Keys[0].Blocked {
		t.Fatalf("got %d %q %+v after %v, want 200 with order-1 blocked", a.got.status, a.got.err, a.got.resp, a.took)
	}
	if a.took > 8*time.Second {
		t.Errorf("answered after %v: the record lingered, the request flushed only once", a.took)
	}
	t.Logf("answered after %v, %d flush notifications", a.took, flushes.Load()-before)
}
