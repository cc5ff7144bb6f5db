package console

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/keygate"
	"github.com/deferq/scheduler/internal/pgtest"
)

// TestPages renders every page on the operator runbook's seed
// (fixture.SeedOps) and checks what each shows.
func TestPages(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	srv := serve(t, testConfig(t), db.Pool)
	c := login(t, srv, "alice")
	tests := []struct {
		name, path string
		code       int
		want       []string
	}{
		{"overview", "/", 200, []string{`id="targets"`, `data-target="orders.retry"`, `id="attention"`, "held by parked message 104"}},
		{"messages", "/messages", 200, []string{`id="messages"`, `data-id="101"`, `data-id="111"`}},
		{"message", "/messages/101", 200, []string{`id="payload"`, `id="headers"`, `id="history"`, `id="key-messages"`, "&#34;order&#34;: 1", `\x00ff`}},
		{"gone message", "/messages/112", 200, []string{"is gone", `id="history"`}},
		{"key", "/keys?key=order-3", 200, []string{`id="key-messages"`, "Held by parked message 104", `data-action="replay"`}},
		{"parked", "/parked", 200, []string{`id="parked"`, `data-target="payments.retry"`, "unknown_topic"}},
		{"rejected", "/rejected", 200, []string{`id="rejected"`, `data-id="106"`, "missing_target"}},
		{"targets", "/targets", 200, []string{`id="targets"`, `data-target="audit.retry"`, "seeded pause"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := c.get(tt.path)
			mustHave(t, tt.path, r, tt.code, tt.want...)
			if r.code == http.StatusOK && r.header.Get("Cache-Control") != "no-store" {
				t.Errorf("Cache-Control %q", r.header.Get("Cache-Control"))
			}
		})
	}
}

// TestMessagesFilters checks each filter of /messages, and that bad input
// gets a 400 naming the field.
func TestMessagesFilters(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	c := login(t, serve(t, testConfig(t), db.Pool), "victor")
	tests := []struct {
		query     string
		ids, not  []string
		code      int
		wantError string
	}{
		{query: "state=parked", ids: []string{"104", "105"}, not: []string{"101", "106"}},
		{query: "target=payments.*", ids: []string{"103", "104", "105"}, not: []string{"101"}},
		{query: "target=orders.retr%3F", ids: []string{"101", "107"}, not: []string{"103"}},
		{query: "key=order-1", ids: []string{"101", "102"}, not: []string{"103"}},
		{query: "key=order-1&state=pending&target=orders.*", ids: []string{"101", "102"}, not: []string{"103"}},
		{query: "key=order-3&state=pending", not: []string{"104"}},
		{query: "key=order-3&reason=unknown_topic", ids: []string{"104"}},
		{query: "key=order-1&cursor=x", code: 400, wantError: "seq_id"},
		{query: "reason=missing_target", ids: []string{"106", "108"}, not: []string{"107"}},
		{query: "error_class=Provider*", ids: []string{"101"}, not: []string{"109"}},
		{query: "state=pending&sort=due", ids: []string{"101", "109", "110"}, not: []string{"104"}},
		{query: "since=1h", ids: []string{"101", "106"}, not: []string{"108"}},
		{query: "until=1h", ids: []string{"108"}, not: []string{"101"}},
		{query: "state=done", code: 400, wantError: `state &#34;done&#34; is not valid: want pending, parked, rejected`},
		{query: "sort=size", code: 400, wantError: "sort"},
		{query: "since=yesterday", code: 400, wantError: "since"},
		{query: "reason=unknown_topic:%20x", code: 400, wantError: "reason code"},
		{query: "target=a[b", code: 400, wantError: "target"},
		{query: "limit=0", code: 400, wantError: "limit"},
		{query: "sort=due&cursor=42", code: 400, wantError: "cursor"},
	}
	for _, tt := range tests {
		t.Run(tt.query, func(t *testing.T) {
			r := c.get("/messages?" + tt.query)
			if tt.code != 0 {
				mustHave(t, tt.query, r, tt.code, tt.wantError, `id="error"`, "Nothing was changed")
				return
			}
			mustHave(t, tt.query, r, 200, `id="messages"`)
			for _, id := range tt.ids {
				if !strings.Contains(r.body, `data-id="`+id+`"`) {
					t.Errorf("lacks message %s", id)
				}
			}
			for _, id := range tt.not {
				if strings.Contains(r.body, `data-id="`+id+`"`) {
					t.Errorf("shows message %s", id)
				}
			}
		})
	}
}

// TestMessagesPages walks every page of 120 messages in each order: each
// message once, in order, and the last page has no next link.
func TestMessagesPages(t *testing.T) {
	db := pgtest.NewDB(t)
	var rows []fixture.Message
	for i := range 120 {
		// Due times out of id order, some equal, so the cursor's tie-break
		// matters. One key each: sorted by due time, only key heads are
		// listed (TestMessagesDueListsHeads).
		rows = append(rows, fixture.Message{Key: fixture.Key(fmt.Sprintf("k%d", i)), Target: "orders.retry",
			In: time.Duration((i*37)%50) * time.Minute})
	}
	ids := fixture.Insert(t, db.Pool, rows...)
	c := login(t, serve(t, testConfig(t), db.Pool), "victor")
	next := regexp.MustCompile(`id="next-page" rel="next" href="([^"]+)"`)
	row := regexp.MustCompile(`<tr data-id="(\d+)"`)
	for _, sort := range []string{"oldest", "newest", "due"} {
		t.Run(sort, func(t *testing.T) {
			var seen []int64
			path, pages := "/messages?target=orders.*&sort="+sort, 0
			for path != "" {
				pages++
				r := c.get(path)
				mustHave(t, path, r, 200)
				for _, m := range row.FindAllStringSubmatch(r.body, -1) {
					id, _ := strconv.ParseInt(m[1], 10, 64)
					seen = append(seen, id)
				}
				path = ""
				if m := next.FindStringSubmatch(r.body); m != nil {
					path = unescape(m[1])
				}
			}
			if pages != 3 || len(seen) != len(ids) {
				t.Fatalf("%d pages, %d rows; want 3 pages, %d rows", pages, len(seen), len(ids))
			}
			var want []int64
			q := map[string]string{"oldest": "ORDER BY id", "newest": "ORDER BY id DESC", "due": "ORDER BY next_run_at, id"}[sort]
			rs, _ := db.Pool.Query(context.Background(), "SELECT id FROM deferred_message "+q)
			want, err := pgx.CollectRows(rs, pgx.RowTo[int64])
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(seen, want) {
				t.Errorf("order %v\nwant %v", seen, want)
			}
		})
	}
}

// TestMessagesDueListsHeads: sorted by due time, pending messages are listed
// as dispatch takes them, the head of each key by its key's due time; the
// messages waiting behind a head are not, whatever their own due time.
func TestMessagesDueListsHeads(t *testing.T) {
	db := pgtest.NewDB(t)
	ids := fixture.Insert(t, db.Pool,
		fixture.Message{Key: fixture.Key("a"), Target: "orders.retry", In: time.Hour},
		fixture.Message{Key: fixture.Key("a"), Target: "orders.retry", In: -time.Hour}, // waits behind the first
		fixture.Message{Key: fixture.Key("b"), Target: "orders.retry", In: time.Minute},
		fixture.Message{Key: fixture.Key("c"), Target: "payments.retry", In: 0})
	c := login(t, serve(t, testConfig(t), db.Pool), "victor")
	row := regexp.MustCompile(`<tr data-id="(\d+)"`)
	for _, tt := range []struct {
		path string
		want []int64
	}{
		{"/messages?sort=due", []int64{ids[3], ids[2], ids[0]}},
		{"/messages?sort=due&state=pending&target=orders.*", []int64{ids[2], ids[0]}},
		{"/messages?sort=oldest&key=a", []int64{ids[0], ids[1]}},
	} {
		r := c.get(tt.path)
		mustHave(t, tt.path, r, 200)
		var seen []int64
		for _, m := range row.FindAllStringSubmatch(r.body, -1) {
			id, _ := strconv.ParseInt(m[1], 10, 64)
			seen = append(seen, id)
		}
		if !slices.Equal(seen, tt.want) {
			t.Errorf("%s: rows %v, want %v", tt.path, seen, tt.want)
		}
	}
}

// TestMessagePage checks the message page's parts and bad ids.
func TestMessagePage(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	cfg := testConfig(t)
	c := login(t, serve(t, cfg, db.Pool), "victor")

	r := c.get("/messages/101")
	mustHave(t, "101", r, 200,
		`<pre id="payload" class="payload payload-json">{
  &#34;order&#34;: 1
}</pre>`,
		`<code class="enc-hex">\x00ff</code>`, // binary header as hex
		`café`, `\x1b[2J`,                     // non-ASCII as is; an escape sequence escaped
		`<tr data-id="101" class="current" aria-current="true">`, `<tr data-id="102">`, // its key, this one marked
		`re-deferral`, `id="history"`)
	mustHave(t, "binary value", c.get("/messages/103"), 200, `payload-hex">\xdeadbeef</pre>`)
	mustHave(t, "held", c.get("/messages/104"), 200, `holds its key`, `holds the key</span>`)
	mustHave(t, "gone", c.get("/messages/112"), 200, "is gone", `<tr data-id="112" class="event-deferred">`)
	mustHave(t, "unknown", c.get("/messages/999"), 404, "There is no message 999", `id="error"`)
	mustHave(t, "not an id", c.get("/messages/abc"), 400, "message id", `id="error"`)
	mustHave(t, "no page", c.get("/nowhere"), 404, "There is no page /nowhere")

	t.Run("payload preview off", func(t *testing.T) {
		cfg := cfg
		cfg.PayloadPreview = false
		c := login(t, serve(t, cfg, db.Pool), "victor")
		r := c.get("/messages/101")
		mustHave(t, "hidden", r, 200, "CONSOLE_PAYLOAD_PREVIEW=false", `id="payload"`, "<em>hidden</em>")
		for _, secret := range []string{"&#34;order&#34;", `\x00ff`, "café"} {
			if strings.Contains(r.body, secret) {
				t.Errorf("shows %q with payload preview off", secret)
			}
		}
	})
}

// TestKeyPage: any character in a key, why a key is blocked, its pages.
func TestKeyPage(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	odd := "a key/with?odd&chars=#\" <b>"
	var rows []fixture.Message
	for range 60 {
		rows = append(rows, fixture.Message{Key: fixture.Key(odd), Target: "orders.retry", In: time.Hour})
	}
	fixture.Insert(t, db.Pool, rows...)
	c := login(t, serve(t, testConfig(t), db.Pool), "alice")

	r := c.get("/keys?key=" + url.QueryEscape(odd))
	mustHave(t, "odd key", r, 200, "a key/with?odd&amp;chars=#&#34; &lt;b&gt;", `id="next-page"`, "Not blocked: its head")
	if n := strings.Count(r.body, `<tr data-id=`); n != 50 {
		t.Errorf("%d rows on the first page, want 50", n)
	}
	m := regexp.MustCompile(`id="next-page" rel="next" href="([^"]+)"`).FindStringSubmatch(r.body)
	r = c.get(unescape(m[1]))
	if n := strings.Count(r.body, `<tr data-id=`); n != 10 || strings.Contains(r.body, `id="next-page"`) {
		t.Errorf("second page: %d rows, want 10 and no next page", n)
	}
	for _, tt := range []struct{ key, want string }{
		{"order-3", "Held by parked message 104"},
		{"held-1", "Backing off after 3 failed publish(es)"},
		{"leased-1", "Leased by test-loop"},
		{"nobody", "Nothing of this key waits"},
	} {
		mustHave(t, tt.key, c.get("/keys?key="+tt.key), 200, tt.want)
	}
	mustHave(t, "no key", c.get("/keys"), 400, "key", `id="error"`)
	mustHave(t, "bad cursor", c.get("/keys?key=a&cursor=x"), 400, "cursor")

	// A paused target is a reason too.
	if _, err := db.Pool.Exec(context.Background(), `UPDATE target_control SET paused = true, note = 'INC-9' WHERE target_topic = 'audit.retry';
		INSERT INTO target_control (target_topic, paused, note) VALUES ('orders.retry', true, 'deploy')`); err != nil {
		t.Fatal(err)
	}
	mustHave(t, "paused", c.get("/keys?key=order-1"), 200, "Its target orders.retry is paused (deploy)")
}

// TestOverviewJSON is what the overview's script polls.
func TestOverviewJSON(t *testing.T) {
	db := pgtest.NewDB(t)
	fixture.SeedOps(t, db.Pool)
	c := login(t, serve(t, testConfig(t), db.Pool), "victor")
	r := c.get("/api/overview")
	mustHave(t, "json", r, 200)
	var d struct {
		Targets []struct {
			Target   *string `json:"target_topic"`
			Pending  int64   `json:"pending"`
			Due      int64   `json:"due"`
			Parked   int64   `json:"parked"`
			Rejected int64   `json:"rejected"`
			Paused   bool    `json:"paused"`
			Late     float64 `json:"lateness_seconds"`
		} `json:"targets"`
		HeldTotal int `json:"held_keys_total"`
		Attention []struct {
			Text string `json:"text"`
		} `json:"attention"`
	}
	if err := json.Unmarshal([]byte(r.body), &d); err != nil {
		t.Fatalf("%v\n%s", err, r.body)
	}
	got := map[string]string{}
	for _, x := range d.Targets {
		got[deref(x.Target)] = fmt.Sprintf("pending %d due %d parked %d rejected %d paused %v late %v",
			x.Pending, x.Due, x.Parked, x.Rejected, x.Paused, x.Late > 100)
	}
	want := map[string]string{
		"":               "pending 0 due 0 parked 0 rejected 2 paused false late false",
		"orders.retry":   "pending 5 due 2 parked 0 rejected 1 paused false late true",
		"payments.retry": "pending 1 due 0 parked 2 rejected 0 paused false late false",
		"audit.retry":    "pending 0 due 0 parked 0 rejected 0 paused true late false",
		"bulk.retry":     "pending 0 due 0 parked 0 rejected 0 paused false late false",
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%q: %s, want %s", k, got[k], w)
		}
	}
	if d.HeldTotal != 3 || len(d.Attention) == 0 || !strings.Contains(d.Attention[0].Text, "orders.retry is late") {
		t.Errorf("held %d, attention %v", d.HeldTotal, d.Attention)
	}
}

// TestOverviewEstimatesLargeTables: above 20,000 rows the overview's pending
// counts come from a sample, are marked estimated and stay near the truth;
// the parked count stays exact.
func TestOverviewEstimatesLargeTables(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `
		INSERT INTO deferred_message (business_key, target_topic, next_run_at, state, reason)
		SELECT 'k' || g, CASE WHEN g % 4 = 0 THEN 'orders.retry' ELSE 'bulk.retry' END,
		       CASE WHEN g % 10 = 0 THEN now() - interval '1 second' ELSE now() + interval '1 day' END,
		       CASE WHEN g % 1000 = 0 THEN 'parked' ELSE 'pending' END,
		       CASE WHEN g % 1000 = 0 THEN 'operator: test' END
		FROM generate_series(1, 80000) g;
		ANALYZE deferred_message`); err != nil {
		t.Fatal(err)
	}
	c := login(t, serve(t, testConfig(t), db.Pool), "victor")
	r := c.get("/api/overview")
	mustHave(t, "json", r, 200)
	var d struct {
		Targets []struct {
			Target    *string `json:"target_topic"`
			Pending   int64   `json:"pending"`
			Due       int64   `json:"due"`
			Parked    int64   `json:"parked"`
			Estimated bool    `json:"estimated"`
		} `json:"targets"`
	}
	if err := json.Unmarshal([]byte(r.body), &d); err != nil {
		t.Fatalf("%v\n%s", err, r.body)
	}
	// bulk.retry: 60,000 pending, 4,000 of them due. orders.retry: 20,000
	// rows, 80 of them parked, 3,920 due.
	want := map[string][3]int64{"bulk.retry": {60000, 4000, 0}, "orders.retry": {19920, 3920, 80}}
	for _, x := range d.Targets {
		w, ok := want[deref(x.Target)]
		if !ok {
			continue
		}
		delete(want, deref(x.Target))
		if !x.Estimated {
			t.Errorf("%s: not marked estimated on %d rows", deref(x.Target), 80000)
		}
		for i, got := range []int64{x.Pending, x.Due} {
			if float64(got) < 0.6*float64(w[i]) || float64(got) > 1.4*float64(w[i]) {
				t.Errorf("%s: estimate %d, true count %d: off by more than 40%%", deref(x.Target), got, w[i])
			}
		}
		if x.Parked != w[2] {
			t.Errorf("%s: parked %d, want exactly %d", deref(x.Target), x.Parked, w[2])
		}
	}
	if len(want) > 0 {
		t.Errorf("targets missing from the overview: %v", want)
	}
	mustHave(t, "page", c.get("/"), 200, "estimated from a sample")
}

// TestOverviewIngest: the overview shows how far ingest has stored each
// partition of the defer topic and, with Kafka's high-water marks, how many
// records wait; a partition that has records waiting and has not moved for
// minutes needs attention. Without Kafka it says the lag is unknown.
func TestOverviewIngest(t *testing.T) {
	db := pgtest.NewDB(t)
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{"scheduler.defer"}, Partitions: 2})
	sc := sarama.NewConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	client, err := sarama.NewClient([]string{addr}, sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	producer, err := sarama.NewSyncProducerFromClient(client)
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: "scheduler.defer", Partition: 0, Value: sarama.StringEncoder("x")}); err != nil {
			t.Fatal(err)
		}
	}
	// Where ingest stopped: two records of partition 0 stored, ten minutes
	// ago; partition 1 is empty.
	if _, err := db.Pool.Exec(t.Context(), `INSERT INTO ingest_offset (topic, partition, next_offset, updated_at)
		VALUES ('scheduler.defer', 0, 2, now() - interval '10 minutes'), ('scheduler.defer', 1, 0, now())`); err != nil {
		t.Fatal(err)
	}
	type ingest struct {
		Partition int32  `json:"partition"`
		Next      int64  `json:"next_offset"`
		Lag       *int64 `json:"lag"`
	}
	read := func(cfg Config) (d struct {
		Ingest    []ingest `json:"ingest"`
		Note      string   `json:"ingest_note"`
		Attention []struct {
			Text string `json:"text"`
		} `json:"attention"`
	}) {
		r := login(t, serve(t, cfg, db.Pool), "victor").get("/api/overview")
		mustHave(t, "json", r, 200)
		if err := json.Unmarshal([]byte(r.body), &d); err != nil {
			t.Fatalf("%v\n%s", err, r.body)
		}
		return d
	}

	cfg := testConfig(t)
	cfg.HighWaterMarks = func() (map[int32]int64, error) {
		return keygate.KafkaOffsets{Client: client}.HighWaterMarks("scheduler.defer")
	}
	d := read(cfg)
	got := fmt.Sprint(len(d.Ingest))
	for _, r := range d.Ingest {
		lag := "none"
		if r.Lag != nil {
			lag = strconv.FormatInt(*r.Lag, 10)
		}
		got += fmt.Sprintf(" p%d next %d lag %s", r.Partition, r.Next, lag)
	}
	if want := "2 p0 next 2 lag 3 p1 next 0 lag 0"; got != want || d.Note != "" {
		t.Errorf("ingest %q, note %q; want %q and no note", got, d.Note, want)
	}
	var stuck bool
	for _, a := range d.Attention {
		stuck = stuck || strings.Contains(a.Text, "ingest is not moving on partition 0: 3 record(s) wait")
	}
	if !stuck {
		t.Errorf("attention does not name the stuck partition: %+v", d.Attention)
	}

	d = read(testConfig(t)) // no Kafka
	if len(d.Ingest) != 2 || d.Ingest[0].Lag != nil || !strings.Contains(d.Note, "unknown") {
		t.Errorf("without Kafka: ingest %+v, note %q; want positions, no lag, a note", d.Ingest, d.Note)
	}
}

// TestFavicon: the icon browsers ask for on every page exists, so that no
// page logs a 404.
func TestFavicon(t *testing.T) {
	db := pgtest.NewDB(t)
	c := newClient(t, serve(t, testConfig(t), db.Pool))
	if r := c.get("/favicon.ico"); r.code != http.StatusMovedPermanently || r.header.Get("Location") != "/static/favicon.svg" {
		t.Errorf("/favicon.ico: %d to %q; want 301 to /static/favicon.svg", r.code, r.header.Get("Location"))
	}
	if r := c.get("/static/favicon.svg"); r.code != http.StatusOK || !strings.Contains(r.header.Get("Content-Type"), "image/svg+xml") {
		t.Errorf("/static/favicon.svg: %d, %q", r.code, r.header.Get("Content-Type"))
	}
}
