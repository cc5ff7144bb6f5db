package ingest

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/highwater"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/sql/queries"
)

// copyCases are records of every kind ingest stores: what the COPY and the
// INSERT statement write for them must be the same.
func copyCases() []Entry {
	target := "orders.created"
	at := time.Date(2031, 2, 3, 4, 5, 6, 123456000, time.UTC)
	exhausted := &protocol.ParkReason{Code: "retries_exhausted", Detail: "attempt 5 of 5"}
	return []Entry{
		{Record: protocol.Record{Key: []byte("k-1"), Value: []byte("v"), Headers: hs("trace", "t1", "trace", "t2")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-1", Ordered: true, Delay: 1500*time.Millisecond + 250*time.Microsecond}},
		{Record: protocol.Record{Key: []byte("k-2"), Value: []byte("v")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-2", Ordered: true, HasAt: true, At: at}},
		{Record: protocol.Record{Value: []byte("unordered")},
			Schedule: protocol.Schedule{Target: target, Delay: time.Minute}},
		// A re-deferral keeps its seq and lineage; the record after it of
		// the same key takes a fresh seq, so it stays behind.
		{Record: protocol.Record{Key: []byte("k-3"), Value: []byte("again")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-3", Ordered: true, Delay: time.Hour, Attempt: 3,
				ErrorClass: "TimeoutException", ErrorMessage: "read timed out ✓", OriginID: 42, Seq: 7, RedriveCount: 2}},
		{Record: protocol.Record{Key: []byte("k-3"), Value: []byte("later")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-3", Ordered: true, FromPolicy: true},
			Decision: protocol.Decision{Delay: 90 * time.Second}},
		{Record: protocol.Record{Key: []byte("k-4"), Value: []byte("gated")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-4", Ordered: true, Group: "billing", Gated: true}},
		{Record: protocol.Record{Key: []byte("k-5"), Value: []byte("parked")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-5", Ordered: true, Attempt: 5, ErrorClass: "E"},
			Decision: protocol.Decision{Park: exhausted, DLQTopic: "orders.dlq"}},
		{Record: protocol.Record{Key: []byte("k-6"), Value: []byte("parked, key released")},
			Schedule: protocol.Schedule{Target: target, BusinessKey: "k-6", Ordered: true},
			Decision: protocol.Decision{Park: exhausted, ReleaseKey: true}},
		{Record: protocol.Record{Key: []byte{}, Value: nil, Headers: []protocol.Header{hdr("b", nil), hdr("e", []byte{}), {Key: []byte{0xff, 0x00}, Value: []byte("x")}}},
			Schedule: protocol.Schedule{BusinessKey: "k-7", Ordered: true},
			Reject:   &protocol.RejectError{Code: "missing_target", Detail: "defer.target is absent"},
			Decision: protocol.Decision{Park: exhausted, DLQTopic: "ignored"}},
	}
}

// stored reads what a path stored: every column of each message (its
// times as offsets from created_at, ids and fresh seqs left out), the
// heads and the history, all keyed by source offset.
func stored(t *testing.T, pool *pgxpool.Pool) (messages, heads, history []string) {
	t.Helper()
	read := func(q string) []string {
		rows, err := pool.Query(context.Background(), q)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var b []byte
			if err := rows.Scan(&b); err != nil {
				t.Fatal(err)
			}
			out = append(out, string(b))
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	messages = read(`
SELECT (to_jsonb(m) - 'id' - 'seq' - 'source_partition' - 'created_at' - 'updated_at' - 'parked_at' - 'next_run_at'
        || jsonb_build_object('seq', CASE WHEN m.origin_id IS NOT NULL THEN m.seq END, -- a re-deferral's own
                              'next_run_at', CASE WHEN m.next_run_at > now() + interval '1 year' THEN m.next_run_at::text
                                                  ELSE (m.next_run_at - m.created_at)::text END,
                              'parked_at', (m.parked_at - m.created_at)::text,
                              'updated_at', (m.updated_at - m.created_at)::text))::text
FROM deferred_message m ORDER BY m.source_offset`)
	heads = read(`
SELECT (to_jsonb(k) - 'head_id' - 'head_seq' || jsonb_build_object('head_offset', m.source_offset,
        'next_run_at', CASE WHEN k.next_run_at > now() + interval '1 year' THEN k.next_run_at::text
                            ELSE (k.next_run_at - m.created_at)::text END))::text
FROM deferred_key k JOIN deferred_message m ON m.id = k.head_id ORDER BY m.source_offset`)
	history = read(`
SELECT (to_jsonb(a) - 'id' - 'lineage_id' - 'message_id' - 'recorded_at' - 'next_run_at' - 'deferred_at'
        || jsonb_build_object('offset', m.source_offset))::text
FROM deferred_attempt a JOIN deferred_message m ON m.id = a.message_id ORDER BY m.source_offset, a.id`)
	return messages, heads, history
}

// TestStoreCopyMatchesStatement stores the same records with COPY and with
// the INSERT statement, each into a database of its own, and compares every
// column, head and history row they wrote; and checks what both report.
func TestStoreCopyMatchesStatement(t *testing.T) {
	ctx := context.Background()
	type result struct {
		messages, heads, history []string
		out                      Inserted
		ids, seqs                []int64
		markID, markSeq          int64
	}
	run := func(t *testing.T, viaCopy bool) result {
		db := pgtest.NewDB(t)
		marks := &highwater.Marks{}
		store := NewStore(db.Pool, marks)
		entries := copyCases()
		for i := range entries {
			entries[i].Offset = int64(10 + i)
		}
		batches := []Batch{{Pos: Position{Topic: storeTopic, Partition: 3, Next: NoPosition}, Entries: entries}}
		var out []BatchResult
		var err error
		if viaCopy {
			out, err = store.copyBatches(ctx, storeTopic, batches)
		} else {
			out, err = store.insertBatches(ctx, storeTopic, len(entries), batches)
		}
		if err != nil || out[0].Err != nil {
			t.Fatalf("store: %v, %v", err, out)
		}
		var r result
		r.messages, r.heads, r.history = stored(t, db.Pool)
		r.out = out[0].Inserted
		rows, err := db.Pool.Query(ctx, "SELECT id, seq FROM deferred_message ORDER BY source_offset")
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var id, seq int64
			if err := rows.Scan(&id, &seq); err != nil {
				t.Fatal(err)
			}
			r.ids = append(r.ids, id)
			r.seqs = append(r.seqs, seq)
		}
		rows.Close()
		r.markID, r.markSeq = marks.Get()
		var pos int64
		if err := db.Pool.QueryRow(ctx, "SELECT next_offset FROM ingest_offset WHERE topic = $1 AND partition = 3", storeTopic).Scan(&pos); err != nil {
			t.Fatal(err)
		}
		if want := entries[len(entries)-1].Offset + 1; pos != want {
			t.Errorf("stored position %d, want %d", pos, want)
		}
		return r
	}
	viaCopy, viaStatement := run(t, true), run(t, false)

	for _, c := range []struct {
		what      string
		got, want []string
	}{
		{"messages", viaCopy.messages, viaStatement.messages},
		{"heads", viaCopy.heads, viaStatement.heads},
		{"history", viaCopy.history, viaStatement.history},
	} {
		if len(c.got) != len(c.want) {
			t.Errorf("%s: COPY wrote %d rows, the statement %d:\n%s\n%s", c.what, len(c.got), len(c.want), c.got, c.want)
			continue
		}
		for i := range c.got {
			if !jsonEqual(c.got[i], c.want[i]) {
				t.Errorf("%s row %d:\nCOPY      %s\nstatement %s", c.what, i, c.got[i], c.want[i])
			}
		}
	}
	want := Inserted{Stored: 9, Rejected: 1, Parked: 2, Gated: 1}
	if viaCopy.out != want || viaStatement.out != want {
		t.Errorf("reported %+v by COPY and %+v by the statement, want %+v", viaCopy.out, viaStatement.out, want)
	}
	// Ids and fresh seqs in offset order, and the marks at the highest.
	for name, r := range map[string]result{"COPY": viaCopy, "statement": viaStatement} {
		var maxID, maxSeq, lastID, lastSeq int64
		for i := range r.ids {
			if r.ids[i] <= lastID {
				t.Errorf("%s: id %d at offset %d not above %d", name, r.ids[i], 10+i, lastID)
			}
			lastID, maxID = r.ids[i], max(maxID, r.ids[i])
			if r.seqs[i] == 7 {
				continue // the re-deferral's own
			}
			if r.seqs[i] <= lastSeq {
				t.Errorf("%s: fresh seq %d at offset %d not above %d", name, r.seqs[i], 10+i, lastSeq)
			}
			lastSeq, maxSeq = r.seqs[i], max(maxSeq, r.seqs[i])
		}
		if r.markID != maxID || r.markSeq != maxSeq {
			t.Errorf("%s: marks %d, %d after the insert, want the highest id and seq stored, %d, %d", name, r.markID, r.markSeq, maxID, maxSeq)
		}
	}
}

func jsonEqual(a, b string) bool {
	var x, y any
	if json.Unmarshal([]byte(a), &x) != nil || json.Unmarshal([]byte(b), &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

// TestStoreCopyPositionMoved checks the COPY path's continuity check: of
// two batches in one call, the one whose position moved stores nothing and
// draws nothing, and the other is stored.
func TestStoreCopyPositionMoved(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	entries := func(from int64) []Entry {
		e := copyCases()[:3]
		for i := range e {
			e[i].Offset = from + int64(i)
		}
		return e
	}
	// Partition 1 has a stored position of 3; the writer believes 0.
	if _, err := store.Insert(ctx, Position{Topic: storeTopic, Partition: 1, Next: NoPosition}, entries(0)); err != nil {
		t.Fatal(err)
	}
	before := countRows(t, db.Pool)
	out, err := store.copyBatches(ctx, storeTopic, []Batch{
		{Pos: Position{Topic: storeTopic, Partition: 1, Next: NoPosition}, Entries: entries(0)},
		{Pos: Position{Topic: storeTopic, Partition: 2, Next: NoPosition}, Entries: entries(0)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(out[0].Err, ErrPositionMoved) || out[0].Stored != 0 {
		t.Errorf("partition 1: %+v, want nothing stored and ErrPositionMoved", out[0])
	}
	if out[1].Err != nil || out[1].Stored != 3 {
		t.Errorf("partition 2: %+v, want 3 stored", out[1])
	}
	if n := countRows(t, db.Pool); n != before+3 {
		t.Errorf("table holds %d rows, want %d", n, before+3)
	}
	// Nothing matched: nothing is drawn, nothing copied.
	var idBefore, idAfter int64
	if err := db.Pool.QueryRow(ctx, "SELECT last_value FROM deferred_message_id_seq").Scan(&idBefore); err != nil {
		t.Fatal(err)
	}
	out, err = store.copyBatches(ctx, storeTopic, []Batch{{Pos: Position{Topic: storeTopic, Partition: 2, Next: 0}, Entries: entries(0)}})
	if err != nil || !errors.Is(out[0].Err, ErrPositionMoved) {
		t.Fatalf("stale position: %+v, %v; want ErrPositionMoved", out, err)
	}
	if err := db.Pool.QueryRow(ctx, "SELECT last_value FROM deferred_message_id_seq").Scan(&idAfter); err != nil {
		t.Fatal(err)
	}
	if idAfter != idBefore {
		t.Errorf("ids drawn for a batch that did not match: last_value %d, then %d", idBefore, idAfter)
	}
}

// TestStoreCopyFallsBack checks what InsertBatches does with a batch large
// enough for COPY that holds a record stored before: the COPY fails whole
// on the unique source coordinates, and the INSERT statement stores the
// rest, as it would have alone. A write one record smaller goes to the
// statement directly.
func TestStoreCopyFallsBack(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	entries := make([]Entry, copyMinRecords+1)
	for i := range entries {
		entries[i] = copyCases()[0]
		entries[i].Offset = int64(i)
	}
	entries[7].Offset = 6 // the same record twice in one batch
	for i := 8; i < len(entries); i++ {
		entries[i].Offset = int64(i - 1)
	}
	lastID := func() int64 {
		var id int64
		if err := db.Pool.QueryRow(ctx, "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM deferred_message_id_seq").Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id // the last id drawn, 0 for none
	}
	before := lastID()
	n, err := store.Insert(ctx, Position{Topic: storeTopic, Partition: 0, Next: NoPosition}, entries)
	if err != nil {
		t.Fatal(err)
	}
	if n.Stored != int64(len(entries)-1) {
		t.Errorf("stored %d of %d records, one of them twice; want %d", n.Stored, len(entries), len(entries)-1)
	}
	if got := countRows(t, db.Pool); got != int64(len(entries)-1) {
		t.Errorf("table holds %d rows, want %d", got, len(entries)-1)
	}
	// COPY went first: the ids it drew are gone with its transaction (a
	// sequence does not roll back), so the statement's start past them.
	var first int64
	if err := db.Pool.QueryRow(ctx, "SELECT min(id) FROM deferred_message").Scan(&first); err != nil {
		t.Fatal(err)
	}
	if first <= before+int64(len(entries)) {
		t.Errorf("first id stored %d, last drawn before %d: no COPY was tried before the statement", first, before)
	}

	// One record fewer, the same duplicate: the statement alone, so no id
	// is drawn by a COPY rolled back.
	small := entries[:copyMinRecords-1]
	for i := range small {
		small[i].Offset = 1000 + int64(i)
	}
	small[7].Offset = small[6].Offset
	before = lastID()
	pos := Position{Topic: storeTopic, Partition: 0, Next: int64(len(entries)) - 1}
	if n, err = store.Insert(ctx, pos, small); err != nil {
		t.Fatal(err)
	}
	if n.Stored != int64(len(small)-1) {
		t.Errorf("stored %d of %d records, one of them twice; want %d", n.Stored, len(small), len(small)-1)
	}
	if err := db.Pool.QueryRow(ctx, "SELECT min(id) FROM deferred_message WHERE source_offset >= 1000").Scan(&first); err != nil {
		t.Fatal(err)
	}
	if first != before+1 {
		t.Errorf("a write of %d records: first id stored %d, last drawn before %d; want the next id, from the statement alone", len(small), first, before)
	}
}

// TestWritesShareTheirContinuityCheck checks that the statement before the
// COPY checks and moves positions with the INSERT statement's very words
// (docs/design.md 6.3): the two paths must not drift apart.
func TestWritesShareTheirContinuityCheck(t *testing.T) {
	const from, to = "), moved AS (", "), position AS MATERIALIZED ("
	check := func(file string) string {
		st, ok := queries.Lookup(file)
		if !ok {
			t.Fatalf("no statement %s", file)
		}
		i, j := strings.Index(st.SQL, from), strings.Index(st.SQL, to)
		if i < 0 || j < i {
			t.Fatalf("%s has no %q ... %q", file, from, to)
		}
		return st.SQL[i:j]
	}
	if check("ingest_prepare.sql") != check("ingest_insert.sql") {
		t.Error("ingest_prepare.sql and ingest_insert.sql check and move positions differently")
	}
}
