package keygate_test

import (
	"bytes"
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/sql/queries"
)

// postTo sends v as JSON to the handler of path and decodes a 200 answer
// into out; it returns the status and, otherwise, the error said.
func postTo(t *testing.T, h http.HandlerFunc, path string, v, out any) (int, string) {
	t.Helper()
	body, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return postRaw(t, h, path, body, out)
}

func postRaw(t *testing.T, h http.HandlerFunc, path string, body []byte, out any) (int, string) {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	h(w, r)
	if w.Code != http.StatusOK {
		var e keystate.ErrorResponse
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error == "" {
			t.Errorf("%d with a body that is not an ErrorResponse: %q", w.Code, w.Body.String())
		}
		return w.Code, e.Error
	}
	dec := json.NewDecoder(w.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(out); err != nil {
		t.Errorf("200 with a body that is not the answer expected: %v", err)
	}
	return w.Code, ""
}

// loadSet reads every page of group's blocked keys, limit keys a page, and
// returns them by key with the first page's cursor.
func loadSet(t *testing.T, e *env, group string, limit int) (map[string]keystate.State, string, int) {
	t.Helper()
	set := map[string]keystate.State{}
	req := keystate.SetRequest{Group: group, Limit: limit, Wait: keystate.WaitPositions}
	cursor, pages := "", 0
	for {
		var page keystate.SetResponse
		if status, why := postTo(t, e.srv.ServeSet, keystate.SetPath, req, &page); status != 200 {
			t.Fatalf("page %d: %d %s", pages, status, why)
		}
		pages++
		if cursor == "" {
			cursor = page.Cursor
		}
		for _, st := range page.Keys {
			if _, dup := set[st.Key]; dup {
				t.Errorf("key %q on two pages", st.Key)
			}
			set[st.Key] = st
		}
		if page.Next == "" {
			return set, cursor, pages
		}
		req = keystate.SetRequest{Group: group, After: page.Next, Limit: limit}
	}
}

// changes asks what changed since cursor, with keys besides.
func changes(t *testing.T, e *env, group, cursor string, keys ...string) keystate.ChangesResponse {
	t.Helper()
	var resp keystate.ChangesResponse
	if status, why := postTo(t, e.srv.ServeChanges, keystate.ChangesPath,
		keystate.ChangesRequest{Group: group, Cursor: cursor, Keys: keys}, &resp); status != 200 {
		t.Fatalf("changes: %d %s", status, why)
	}
	return resp
}

func byKey(states []keystate.State) map[string]keystate.State {
	m := map[string]keystate.State{}
	for _, st := range states {
		m[st.Key] = st
	}
	return m
}

func exec(t *testing.T, e *env, sql string, args ...any) {
	t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// TestKeySetFollowsEveryChange: a group's blocked keys load page by page,
// then the feed reports every change an operator or the scheduler makes
// that may block or free a key for the group, and nothing of other groups.
func TestKeySetFollowsEveryChange(t *testing.T) {
	t.Parallel()
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
		msg("published", fixture.Message{}),
	)
	setGroup(t, pool, "payments", ids[0], ids[1], ids[2], ids[3], ids[4], ids[7])
	setGroup(t, pool, "shipping", ids[5])
	exec(t, e, `INSERT INTO deferred_inflight (group_id, business_key, target_topic, partition, record_offset, message_id, seq)
		VALUES ('payments', 'in-flight', 'orders.created', 0, 17, 999, 3)`)
	exec(t, e, `INSERT INTO ingest_offset (topic, partition, next_offset) VALUES ($1, 0, 42)`, topic)

	want := []string{"in-flight", "parked-holds", "pending", "published", "rejected"}
	for _, limit := range []int{1, 2, 0} {
		set, _, pages := loadSet(t, e, "payments", limit)
		if got := slices.Sorted(maps.Keys(set)); !slices.Equal(got, want) {
			t.Errorf("limit %d: set %v, want %v", limit, got, want)
		}
		if limit == 2 && pages != 3 {
			t.Errorf("limit 2: %d pages, want 3", pages)
		}
		if st := set["pending"]; st.Reason != keystate.ReasonPending || st.HeadID != ids[0] {
			t.Errorf("limit %d: pending is %+v, want pending behind message %d", limit, st, ids[0])
		}
	}
	set, cursor, _ := loadSet(t, e, "payments", 0)
	if set["in-flight"].Reason != keystate.ReasonInFlight {
		t.Errorf("in-flight is %+v", set["in-flight"])
	}

	// Asked keys come back with the ingest positions read with them. The
	// changes made before the load may come again besides (a transaction
	// of another database held the cursor back), each with its state now.
	got := changes(t, e, "payments", cursor, "never-deferred", "pending")
	if got.Reset || got.Stored[0] != 42 {
		t.Fatalf("asked keys: %+v, want no reset, stored 42", got)
	}
	k := byKey(got.Keys)
	if st, ok := k["never-deferred"]; !ok || st.Blocked {
		t.Errorf("never-deferred: %+v (given %v), want free", st, ok)
	}
	if st, ok := k["pending"]; !ok || !st.Blocked {
		t.Errorf("pending: %+v (given %v), want blocked", st, ok)
	}
	checkTrue(t, e, "payments", got.Keys)
	cursor = got.Cursor

	// Keys given with where the client's deferral went are answered once
	// ingest has stored past it, not before.
	var pos keystate.ChangesResponse
	if status, why := postTo(t, e.srv.ServeChanges, keystate.ChangesPath, keystate.ChangesRequest{Group: "payments", Cursor: cursor,
		Keys:      []string{"stored", "not-yet", "other-partition"},
		Positions: []keystate.Position{{Partition: 0, Offset: 41}, {Partition: 0, Offset: 42}, {Partition: 7, Offset: 0}}}, &pos); status != 200 {
		t.Fatalf("changes with positions: %d %s", status, why)
	}
	k = byKey(pos.Keys)
	_, early := k["not-yet"]
	_, elsewhere := k["other-partition"]
	if k["stored"].Key != "stored" || early || elsewhere {
		t.Errorf("with positions (ingest at 42 in partition 0, nothing in 7): %+v, want \"stored\" and neither other", pos.Keys)
	}

	// The finalize moves "published" in flight: no change.
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{
		`SELECT set_config('scheduler.finalizing', 'on', true)`,
		`DELETE FROM deferred_message WHERE business_key = 'published'`,
		`INSERT INTO deferred_inflight (group_id, business_key, target_topic, partition, record_offset, message_id, seq)
		 VALUES ('payments', 'published', 'orders.created', 0, 18, 998, 4)`,
	} {
		if _, err := tx.Exec(context.Background(), sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	// What an operator or the scheduler does that may block or free a key.
	exec(t, e, `DELETE FROM deferred_message WHERE business_key = 'pending'`)                                         // cancel
	exec(t, e, `UPDATE deferred_message SET park_holds_key = false WHERE business_key = 'parked-holds'`)              // park, release
	exec(t, e, `UPDATE deferred_message SET state = 'pending', reason = NULL WHERE business_key = 'parked-releases'`) // replay
	exec(t, e, `DELETE FROM deferred_inflight WHERE business_key = 'in-flight'`)                                      // release
	exec(t, e, `UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'rejected'`)                     // no change
	exec(t, e, `UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'other-group'`)                  // another group's
	newIDs := fixture.Insert(t, pool, msg("new", fixture.Message{}), msg("shipping-new", fixture.Message{}))
	setGroup(t, pool, "payments", newIDs[0])
	setGroup(t, pool, "shipping", newIDs[1])

	// Every key changed comes with its state now. A key whose change was
	// given before may come again (a transaction of another database held
	// the cursor back): with its state now, that is harmless; another
	// group's keys never come.
	wantStates := map[string]keystate.State{
		"pending":         {Key: "pending"},
		"parked-holds":    {Key: "parked-holds"},
		"parked-releases": {Key: "parked-releases", Blocked: true, Reason: keystate.ReasonPending},
		"in-flight":       {Key: "in-flight"},
		"new":             {Key: "new", Blocked: true, Reason: keystate.ReasonPending},
	}
	// Changes come once every transaction older than them has ended, in
	// any database of the cluster: follow until each has come.
	gotStates, _ := follow(t, e, "payments", cursor, func(m map[string]keystate.State) bool {
		for k := range wantStates {
			if _, ok := m[k]; !ok {
				return false
			}
		}
		return true
	})
	for k, w := range wantStates {
		g, ok := gotStates[k]
		g.HeadSeq, g.HeadID = 0, 0
		if !ok || g != w {
			t.Errorf("change of %q: %+v, want %+v", k, gotStates[k], w)
		}
	}
	for _, other := range []string{"other-group", "shipping-new", "no-group"} {
		if _, ok := gotStates[other]; ok {
			t.Errorf("%q changed for another group or none, and was given to payments", other)
		}
	}
	if n := metricValue2(t, e, "changes", "answered"); n < 2 {
		t.Errorf("changes answered counted %v, want 2 or more", n)
	}
}

// follow asks for changes from cursor until done says the states given so
// far (the last of each key) are enough, for at most a minute, checking
// each answer against the keys' state now; it returns them and the cursor.
func follow(t *testing.T, e *env, group, cursor string, done func(map[string]keystate.State) bool) (map[string]keystate.State, string) {
	t.Helper()
	seen := map[string]keystate.State{}
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		got := changes(t, e, group, cursor)
		if got.Reset {
			t.Fatalf("reset while following from %s", cursor)
		}
		checkTrue(t, e, group, got.Keys)
		for _, st := range got.Keys {
			seen[st.Key] = st
		}
		cursor = got.Cursor
		if done(seen) {
			return seen, cursor
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("changes from %s: %v after a minute", cursor, seen)
	return nil, ""
}

// checkTrue fails unless every state given is the key's state now, as
// deferred_key_state says.
func checkTrue(t *testing.T, e *env, group string, states []keystate.State) {
	t.Helper()
	for _, st := range states {
		rows, err := queries.KeyState(context.Background(), e.db.Pool, queries.KeyStateParams{Group: group, Keys: []string{st.Key}})
		if err != nil || len(rows) != 1 {
			t.Fatalf("state of %q: %v", st.Key, err)
		}
		if rows[0].Blocked != st.Blocked || deref(rows[0].Reason) != st.Reason || deref(rows[0].HeadSeq) != st.HeadSeq {
			t.Errorf("%q given as %+v; its state is %+v", st.Key, st, rows[0])
		}
	}
}

func deref[T any](p *T) T {
	if p == nil {
		var zero T
		return zero
	}
	return *p
}

// metricValue2 returns scheduler_key_set_requests_total{query, result}.
func metricValue2(t *testing.T, e *env, query, result string) float64 {
	t.Helper()
	families, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != metrics.KeySetRequests {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["query"] == query && labels["result"] == result {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestKeyChangesWaitForOlderTransactions: a change committed while an
// older transaction that also changes a key is still open is not given
// until that one ends, since the older one's change would otherwise be
// behind the cursor once it commits: the trap of a feed read by a number.
func TestKeyChangesWaitForOlderTransactions(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	pool := e.db.Pool
	_, cursor, _ := loadSet(t, e, "payments", 0)

	ctx := context.Background()
	slow, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Rollback(ctx)
	insertGrouped(t, slow, "slow")
	fast, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	insertGrouped(t, fast, "fast")
	if err := fast.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	got := changes(t, e, "payments", cursor)
	if len(got.Keys) != 0 || got.Reset {
		t.Fatalf("with an older transaction open: %+v, want nothing yet", got)
	}
	// The change held back shows as behind_ms, which grows as it waits.
	for deadline := time.Now().Add(time.Minute); got.BehindMillis == 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
		if got = changes(t, e, "payments", got.Cursor); len(got.Keys) != 0 {
			t.Fatalf("with an older transaction open: %+v, want nothing yet", got)
		}
	}
	if got.BehindMillis == 0 {
		t.Errorf("behind_ms stayed 0 for a minute with a change held back")
	}
	if err := slow.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	k, _ := follow(t, e, "payments", got.Cursor, func(m map[string]keystate.State) bool { return len(m) == 2 })
	if !k["slow"].Blocked || !k["fast"].Blocked || len(k) != 2 {
		t.Errorf("after it committed: %+v, want slow and fast blocked", k)
	}
}

// insertGrouped stores a pending message of key for group payments in tx.
func insertGrouped(t *testing.T, tx pgx.Tx, key string) {
	t.Helper()
	if _, err := tx.Exec(context.Background(), `
		INSERT INTO deferred_message (business_key, target_topic, next_run_at, header_keys, header_values, group_id)
		VALUES ($1, 'orders.created', now() + interval '1 hour', '{}', '{}', 'payments')`, key); err != nil {
		t.Fatal(err)
	}
}

// TestKeyChangesReset: a cursor the feed cannot follow from (changes
// pruned, a TRUNCATE that names no key, a cursor ahead of the database)
// is answered with reset, and a fresh load follows again.
func TestKeyChangesReset(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	pool := e.db.Pool
	ctx := context.Background()
	resets := []struct {
		name string
		do   func(t *testing.T)
	}{
		{"pruned", func(t *testing.T) {
			row, err := queries.KeyChangePrune(ctx, pool, queries.KeyChangePruneParams{Retention: 0, Batch: 10})
			if err != nil || row.Pruned == 0 {
				t.Fatalf("prune: %+v %v, want rows pruned", row, err)
			}
		}},
		{"truncate deferred_inflight", func(t *testing.T) { exec(t, e, "TRUNCATE deferred_inflight") }},
		{"truncate deferred_message", func(t *testing.T) { exec(t, e, "TRUNCATE deferred_message CASCADE") }},
	}
	for i, r := range resets {
		_, cursor, _ := loadSet(t, e, "payments", 0)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		insertGrouped(t, tx, "key-"+r.name)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		// Changes older than now() in the prune's transaction: wait for
		// the clock to move past the insert's.
		if i == 0 {
			waitClock(t, e)
		}
		r.do(t)
		if got := changes(t, e, "payments", cursor); !got.Reset || len(got.Keys) != 0 {
			t.Errorf("%s: %+v, want reset", r.name, got)
		}
		// A fresh load follows again once the transactions that were
		// open at the reset, in any database of the cluster, have ended.
		followed := false
		for deadline := time.Now().Add(time.Minute); !followed && time.Now().Before(deadline); {
			_, fresh, _ := loadSet(t, e, "payments", 0)
			followed = !changes(t, e, "payments", fresh).Reset
		}
		if !followed {
			t.Errorf("%s: every fresh load reset for a minute", r.name)
		}
	}
	if got := changes(t, e, "payments", "9223372036854775807"); !got.Reset {
		t.Errorf("a cursor ahead of the database: %+v, want reset", got)
	}
	if n := metricValue2(t, e, "changes", "reset"); n < 4 {
		t.Errorf("resets counted %v, want 4 or more", n)
	}
}

// waitClock waits until the database's clock has moved on, so that rows
// written so far are older than a new transaction's now().
func waitClock(t *testing.T, e *env) {
	t.Helper()
	var start time.Time
	if err := e.db.Pool.QueryRow(context.Background(), "SELECT now()").Scan(&start); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		var moved bool
		if err := e.db.Pool.QueryRow(context.Background(), "SELECT now() > $1", start).Scan(&moved); err != nil {
			t.Fatal(err)
		}
		if moved {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("the database's clock did not move in a minute")
}

// TestKeySetFirstPageWaits: the first page waits for ingest to store the
// defer topic, as a key-state request does, unless it says it needs not;
// later pages never wait.
func TestKeySetFirstPageWaits(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.offsets.marks = map[int32]int64{0: 5}
	var page keystate.SetResponse
	status, why := postTo(t, e.srv.ServeSet, keystate.SetPath, keystate.SetRequest{Group: "payments", WaitMillis: 200}, &page)
	// Ingest never stores it here: 503 whatever the machine's speed.
	if status != http.StatusServiceUnavailable || !strings.Contains(why, "scheduler.defer/0") {
		t.Errorf("ingest behind: %d %q, want 503 naming the partition", status, why)
	}
	if status, why := postTo(t, e.srv.ServeSet, keystate.SetPath,
		keystate.SetRequest{Group: "payments", Wait: keystate.WaitPositions}, &page); status != 200 {
		t.Errorf("wait positions: %d %q, want 200", status, why)
	}
	exec(t, e, `INSERT INTO ingest_offset (topic, partition, next_offset) VALUES ($1, 0, 5)`, topic)
	if status, why := postTo(t, e.srv.ServeSet, keystate.SetPath, keystate.SetRequest{Group: "payments"}, &page); status != 200 {
		t.Errorf("caught up: %d %q, want 200", status, why)
	}
	if n := metricValue2(t, e, "set", "unsure"); n != 1 {
		t.Errorf("unsure counted %v, want 1", n)
	}
}

// TestKeySetBadInput: every malformed request is refused with 400 and a
// message naming what is wrong, and changes nothing.
func TestKeySetBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	before := digest(t, e.db.Pool)
	long := strings.Repeat("k", keystate.MaxKeyBytes+1)
	many := make([]string, keystate.MaxKeys+1)
	for i := range many {
		many[i] = "k"
	}
	manyJSON, _ := json.Marshal(keystate.ChangesRequest{Group: "g", Cursor: "1", Keys: many})
	tests := []struct {
		name, path, body, want string
	}{
		{"set not JSON", keystate.SetPath, `{"group":`, "the body is not a key-set request"},
		{"set unknown field", keystate.SetPath, `{"group":"g","keys":["a"]}`, `unknown field "keys"`},
		{"set two values", keystate.SetPath, `{"group":"g"}{}`, "more than one JSON value"},
		{"set no group", keystate.SetPath, `{}`, "group is empty"},
		{"set long group", keystate.SetPath, `{"group":"` + strings.Repeat("g", 256) + `"}`, "group is 256 bytes, at most 255"},
		{"set limit negative", keystate.SetPath, `{"group":"g","limit":-1}`, "limit is -1"},
		{"set limit too big", keystate.SetPath, `{"group":"g","limit":10001}`, "limit is 10001; want 0 (the server's default) to 10000"},
		{"set wait unknown", keystate.SetPath, `{"group":"g","wait":"soon"}`, `wait is "soon"`},
		{"set wait_ms too long", keystate.SetPath, `{"group":"g","wait_ms":10001}`, "wait_ms is 10001"},
		{"set wait on a later page", keystate.SetPath, `{"group":"g","after":"k","wait":"all"}`, "first page only"},
		{"set long after", keystate.SetPath, `{"group":"g","after":"` + long + `"}`, "after is 1025 bytes"},
		{"set after not UTF-8", keystate.SetPath, "{\"group\":\"g\",\"after\":\"\xff\"}", "after is not valid UTF-8"},
		{"changes not JSON", keystate.ChangesPath, `[]`, "the body is not a key-changes request"},
		{"changes no cursor", keystate.ChangesPath, `{"group":"g"}`, `cursor is ""`},
		{"changes cursor not a number", keystate.ChangesPath, `{"group":"g","cursor":"abc"}`, `cursor is "abc"`},
		{"changes cursor negative", keystate.ChangesPath, `{"group":"g","cursor":"-1"}`, `cursor is "-1"`},
		{"changes no group", keystate.ChangesPath, `{"cursor":"1"}`, "group is empty"},
		{"changes empty key", keystate.ChangesPath, `{"group":"g","cursor":"1","keys":["a",""]}`, "keys[1] is empty"},
		{"changes long key", keystate.ChangesPath, `{"group":"g","cursor":"1","keys":["` + long + `"]}`, "keys[0] is 1025 bytes"},
		{"changes key not UTF-8", keystate.ChangesPath, `{"group":"g","cursor":"1","keys":["a","\udc00"]}`, "keys[1] is not valid UTF-8"},
		{"changes too many keys", keystate.ChangesPath, string(manyJSON), "keys holds 1001 keys, at most 1000"},
		{"changes positions not one per key", keystate.ChangesPath, `{"group":"g","cursor":"1","keys":["a","b"],"positions":[{"partition":0,"offset":1}]}`, "positions holds 1 positions for 2 keys"},
		{"changes negative position", keystate.ChangesPath, `{"group":"g","cursor":"1","keys":["a"],"positions":[{"partition":0,"offset":-1}]}`, "positions[0] is partition 0, offset -1"},
	}
	handlers := map[string]http.HandlerFunc{keystate.SetPath: e.srv.ServeSet, keystate.ChangesPath: e.srv.ServeChanges}
	for _, tt := range tests {
		var out any
		status, why := postRaw(t, handlers[tt.path], tt.path, []byte(tt.body), &out)
		if status != http.StatusBadRequest || !strings.Contains(why, tt.want) {
			t.Errorf("%s: %d %q, want 400 containing %q", tt.name, status, why, tt.want)
		}
	}
	for path, h := range handlers {
		r := httptest.NewRequest(http.MethodGet, path, nil)
		w := httptest.NewRecorder()
		h(w, r)
		if w.Code != http.StatusMethodNotAllowed || !strings.Contains(w.Body.String(), "is POST "+path) {
			t.Errorf("GET %s: %d %s, want 405 naming POST", path, w.Code, w.Body.String())
		}
	}
	if after := digest(t, e.db.Pool); after != before {
		t.Errorf("refusals changed the database:\nbefore %s\nafter  %s", before, after)
	}
	if n := metricValue2(t, e, "set", "refused") + metricValue2(t, e, "changes", "refused"); n != float64(len(tests)+2) {
		t.Errorf("refusals counted %v, want %d", n, len(tests)+2)
	}
}
