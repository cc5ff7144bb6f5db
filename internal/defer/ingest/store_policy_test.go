package ingest

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/sql/queries"
)

// policyColumns are the columns of a row that the retry rules set.
type policyColumns struct {
	State        string
	Reason       *string
	ParkedAt     *time.Time
	HoldsKey     bool
	DLQTopic     *string
	RedriveCount int32
	NextRunAt    time.Time
	CreatedAt    time.Time
}

func readPolicyColumns(t testing.TB, pool *pgxpool.Pool, partition int32, offset int64) policyColumns {
	t.Helper()
	var c policyColumns
	err := pool.QueryRow(context.Background(), `
SELECT state, reason, parked_at, park_holds_key, dlq_topic, redrive_count, next_run_at, created_at
FROM deferred_message WHERE source_topic = $1 AND source_partition = $2 AND source_offset = $3`,
		storeTopic, partition, offset).Scan(&c.State, &c.Reason, &c.ParkedAt, &c.HoldsKey, &c.DLQTopic, &c.RedriveCount,
		&c.NextRunAt, &c.CreatedAt)
	if err != nil {
		t.Fatalf("read row %d/%d: %v", partition, offset, err)
	}
	return c
}

// keyHead is a deferred_key row, with next_run_at as text so that
// 'infinity' shows as such.
type keyHead struct {
	HeadOffset int64 // source_offset of the head message
	Held       bool
	NextRunAt  string
}

// readHead returns the head of business key, or false if it has none.
func readHead(t testing.TB, pool *pgxpool.Pool, key string) (keyHead, bool) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT m.source_offset, k.held, k.next_run_at::text
FROM deferred_key k JOIN deferred_message m ON m.id = k.head_id
WHERE k.business_key = $1`, key)
	if err != nil {
		t.Fatalf("read head of %s: %v", key, err)
	}
	defer rows.Close()
	var heads []keyHead
	for rows.Next() {
		var h keyHead
		if err := rows.Scan(&h.HeadOffset, &h.Held, &h.NextRunAt); err != nil {
			t.Fatalf("read head of %s: %v", key, err)
		}
		heads = append(heads, h)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read head of %s: %v", key, err)
	}
	if len(heads) > 1 {
		t.Fatalf("key %s has %d heads", key, len(heads))
	}
	if len(heads) == 0 {
		return keyHead{}, false
	}
	return heads[0], true
}

// TestStoreParkedAtIngest stores rows the retry rules parked next to pending
// ones of the same keys, and checks the columns and the key heads: a parked
// row that holds its key blocks the rest of the key, one under a release
// policy does not, and an unordered one holds nothing.
func TestStoreParkedAtIngest(t *testing.T) {
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	ctx := context.Background()
	exhausted := &protocol.ParkReason{Code: "exhausted", Detail: "3 retries made"}
	permanent := &protocol.ParkReason{Code: "permanent", Detail: `defer.error.class "permanent"`}
	entry := func(off int64, key string, d protocol.Decision) Entry {
		s := protocol.Schedule{Target: "payments.card", FromPolicy: true, Attempt: 3, RedriveCount: 2}
		if key != "" {
			s.BusinessKey, s.Ordered = key, true
		}
		return Entry{Offset: off, Record: protocol.Record{Key: []byte(key), Value: []byte("v")}, Schedule: s, Decision: d}
	}
	const dlq = "payments.card.dlq"
	first := []Entry{
		entry(0, "held", protocol.Decision{Park: exhausted, DLQTopic: dlq}),
		entry(1, "held", protocol.Decision{Delay: time.Second, DLQTopic: dlq}),
		entry(2, "released", protocol.Decision{Park: permanent, ReleaseKey: true}),
		entry(3, "released", protocol.Decision{Delay: 5 * time.Second, ReleaseKey: true}),
		entry(4, "", protocol.Decision{Park: exhausted}), // unordered
		entry(5, "", protocol.Decision{Delay: time.Minute, DLQTopic: dlq}),
		// Rejected: the decision, had there been one, is ignored.
		{Offset: 6, Record: protocol.Record{Key: []byte("rejected")}, Schedule: protocol.Schedule{Target: "payments.card", BusinessKey: "rejected", Ordered: true, RedriveCount: 1},
			Reject: &protocol.RejectError{Code: "invalid_delay", Detail: "d"}, Decision: protocol.Decision{Park: permanent, DLQTopic: dlq}},
	}
	before := dbNow(t, db.Pool)
	n, err := insertNext(ctx, t, store, storeTopic, 0, first)
	if err != nil {
		t.Fatalf("Insert: %v", err)
	}
	if want := (Inserted{Stored: 7, Rejected: 1, Parked: 3}); n != want {
		t.Errorf("Insert = %+v, want %+v", n, want)
	}
	// A later batch: the held key's newcomer waits too.
	later := []Entry{entry(7, "held", protocol.Decision{Delay: 0, DLQTopic: dlq}), entry(8, "released", protocol.Decision{Delay: 0, ReleaseKey: true})}
	if _, err := insertNext(ctx, t, store, storeTopic, 0, later); err != nil {
		t.Fatalf("Insert of the later batch: %v", err)
	}
	after := dbNow(t, db.Pool)

	rows := []struct {
		offset   int64
		state    string
		reason   string // "" for NULL
		holds    bool
		dlq      *string
		delay    time.Duration // next_run_at - created_at
		redrives int32
	}{
		{0, "parked", exhausted.String(), true, ptr(dlq), 0, 2},
		{1, "pending", "", true, ptr(dlq), time.Second, 2},
		{2, "parked", permanent.String(), false, nil, 0, 2},
		{3, "pending", "", false, nil, 5 * time.Second, 2},
		{4, "parked", exhausted.String(), true, nil, 0, 2},
		{5, "pending", "", true, ptr(dlq), time.Minute, 2},
		{6, "rejected", "invalid_delay: d", false, nil, 0, 1},
		{7, "pending", "", true, ptr(dlq), 0, 2},
		{8, "pending", "", false, nil, 0, 2},
	}
	for _, want := range rows {
		got := readPolicyColumns(t, db.Pool, 0, want.offset)
		if got.State != want.state {
			t.Errorf("offset %d: state %q, want %q", want.offset, got.State, want.state)
		}
		if (got.Reason == nil) != (want.reason == "") || got.Reason != nil && *got.Reason != want.reason {
			t.Errorf("offset %d: reason %s, want %q", want.offset, fmtPtr(got.Reason), want.reason)
		}
		if want.state == "parked" {
			if got.ParkedAt == nil || got.ParkedAt.Before(before) || got.ParkedAt.After(after) {
				t.Errorf("offset %d: parked_at %v, want the insert's time (%v .. %v)", want.offset, got.ParkedAt, before, after)
			}
		} else if got.ParkedAt != nil {
			t.Errorf("offset %d: parked_at %v on a %s row, want NULL", want.offset, *got.ParkedAt, got.State)
		}
		if got.HoldsKey != want.holds {
			t.Errorf("offset %d: park_holds_key %v, want %v", want.offset, got.HoldsKey, want.holds)
		}
		if !reflect.DeepEqual(got.DLQTopic, want.dlq) {
			t.Errorf("offset %d: dlq_topic %s, want %s", want.offset, fmtPtr(got.DLQTopic), fmtPtr(want.dlq))
		}
		if d := got.NextRunAt.Sub(got.CreatedAt); d != want.delay {
			t.Errorf("offset %d: next_run_at - created_at = %v, want %v", want.offset, d, want.delay)
		}
		if got.RedriveCount != want.redrives {
			t.Errorf("offset %d: redrive_count %d, want %d", want.offset, got.RedriveCount, want.redrives)
		}
	}

	heads := []struct {
		key  string
		want keyHead
		ok   bool
	}{
		// The parked row holds its key: never due, and the pending rows
		// behind it, of either batch, wait.
		{"held", keyHead{HeadOffset: 0, Held: true, NextRunAt: "infinity"}, true},
		// Under a release policy the next pending row is the head.
		{"released", keyHead{HeadOffset: 3, Held: false}, true},
		{"rejected", keyHead{}, false},
	}
	for _, h := range heads {
		got, ok := readHead(t, db.Pool, h.key)
		if ok != h.ok {
			t.Errorf("key %s has a head: %v, want %v", h.key, ok, h.ok)
			continue
		}
		if !ok {
			continue
		}
		if h.want.NextRunAt == "" {
			// A pending head: its own due time, which is not 'infinity'.
			if got.NextRunAt == "infinity" {
				t.Errorf("key %s: head next_run_at 'infinity', want the head's due time", h.key)
			}
			got.NextRunAt = ""
		}
		if got != h.want {
			t.Errorf("key %s: head %+v, want %+v", h.key, got, h.want)
		}
	}
	// The unordered parked row holds nothing; the unordered pending one is
	// its own head.
	var unorderedHeads []int64
	rowsQ, err := db.Pool.Query(ctx, `SELECT m.source_offset FROM deferred_key k JOIN deferred_message m ON m.id = k.head_id
WHERE k.business_key IS NULL ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rowsQ.Next() {
		var off int64
		if err := rowsQ.Scan(&off); err != nil {
			t.Fatal(err)
		}
		unorderedHeads = append(unorderedHeads, off)
	}
	if err := rowsQ.Err(); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(unorderedHeads, []int64{5}) {
		t.Errorf("unordered heads at offsets %v, want [5] (a parked unordered row is no head)", unorderedHeads)
	}
}

// attemptRow is one deferred_attempt row.
type attemptRow struct {
	Lineage, Message int64
	Event            string
	Attempt          int32
	Reason           *string
	Class, Msg       *string
}

// TestStoreHistoryLineage follows one message through three re-deferrals,
// each delivered (deleted by dispatch's finalize statement) before the
// consumer sends it back with the id of the row it got: the history keeps
// all four as one lineage, named after the first row, with the attempts and
// errors as sent; the last one, out of retries, is parked. The three
// delivered ones have no history row of their own until their delivery,
// which folds their deferral into its 'published' row (migration 0012);
// the view deferred_history shows each as a 'deferred' event before its
// delivery.
func TestStoreHistoryLineage(t *testing.T) {
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	ctx := context.Background()
	rules := policyRules(t) // payments.*: a ladder of three retries

	type send struct{ class, msg string }
	sends := []send{{"", ""}, {"java.net.SocketTimeoutException", "read timed out"}, {"Conflict", "version 7 != 8"}, {"Conflict", "again"}}
	var ids []int64
	for i, sd := range sends {
		kv := []string{protocol.HeaderTarget, "payments.card", protocol.HeaderAttempt, strconv.Itoa(i)}
		if i > 0 {
			kv = append(kv, protocol.HeaderID, strconv.FormatInt(ids[i-1], 10), protocol.HeaderSeq, "5")
		}
		if sd.class != "" {
			kv = append(kv, protocol.HeaderErrorClass, sd.class, protocol.HeaderErrorMessage, sd.msg)
		}
		e := prepare(int64(i), protocol.Record{Key: []byte("order-1"), Value: []byte("v"), Headers: hs(kv...)}, rules, time.Now(), fixedRand(0.5))
		if e.Reject != nil {
			t.Fatalf("send %d rejected: %v", i, e.Reject)
		}
		if _, err := insertNext(ctx, t, store, storeTopic, 0, []Entry{e}); err != nil {
			t.Fatalf("send %d: Insert: %v", i, err)
		}
		var id int64
		if err := db.Pool.QueryRow(ctx, "SELECT id FROM deferred_message WHERE source_offset = $1", i).Scan(&id); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		ids = append(ids, id)
		if i < len(sends)-1 {
			// Delivered: dispatch's finalize deletes the row and records the
			// delivery (under scheduler.finalizing, so that it is no
			// cancel); its history stays.
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				if err := queries.DispatchFinalizing(ctx, tx, queries.DispatchFinalizingParams{Owner: "test"}); err != nil {
					return err
				}
				return queries.DispatchDelete(ctx, tx, queries.DispatchDeleteParams{IDs: []int64{id}})
			}); err != nil {
				t.Fatalf("send %d: deliver: %v", i, err)
			}
		}
	}

	var rawRows int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM deferred_attempt").Scan(&rawRows); err != nil {
		t.Fatal(err)
	}
	if rawRows != len(sends) {
		t.Errorf("%d rows in deferred_attempt, want %d: three deliveries with their deferrals folded in, and the park", rawRows, len(sends))
	}
	rows, err := db.Pool.Query(ctx, `SELECT lineage_id, message_id, event, attempt, reason, error_class, error_message
FROM deferred_history WHERE event <> 'published' ORDER BY recorded_at, id NULLS LAST, event <> 'deferred'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []attemptRow
	for rows.Next() {
		var r attemptRow
		if err := rows.Scan(&r.Lineage, &r.Message, &r.Event, &r.Attempt, &r.Reason, &r.Class, &r.Msg); err != nil {
			t.Fatal(err)
		}
		got = append(got, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(sends) {
		t.Fatalf("%d history rows, want %d: %+v", len(got), len(sends), got)
	}
	for i, r := range got {
		wantEvent := "deferred"
		if i == len(sends)-1 {
			wantEvent = "parked"
		}
		if r.Lineage != ids[0] || r.Message != ids[i] || r.Event != wantEvent || r.Attempt != int32(i) {
			t.Errorf("history row %d: lineage %d message %d event %s attempt %d; want %d, %d, %s, %d",
				i, r.Lineage, r.Message, r.Event, r.Attempt, ids[0], ids[i], wantEvent, i)
		}
		var wantClass, wantMsg *string
		if sends[i].class != "" {
			wantClass, wantMsg = &sends[i].class, &sends[i].msg
		}
		if !reflect.DeepEqual(r.Class, wantClass) || !reflect.DeepEqual(r.Msg, wantMsg) {
			t.Errorf("history row %d: error %s / %s, want %s / %s", i, fmtPtr(r.Class), fmtPtr(r.Msg), fmtPtr(wantClass), fmtPtr(wantMsg))
		}
		if wantEvent == "parked" {
			if r.Reason == nil || !strings.HasPrefix(*r.Reason, "exhausted: 3 retries made") {
				t.Errorf("history row %d: reason %s, want the exhaustion", i, fmtPtr(r.Reason))
			}
		} else if r.Reason != nil {
			t.Errorf("history row %d: reason %s, want NULL", i, fmtPtr(r.Reason))
		}
	}
}
