package ingest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/pgtest"
)

// partEntries returns n entries of partition p from offset from on, each
// with its own business key and p+1 headers, and value "p/offset" (or
// marker, for the offset equal to markAt).
func partEntries(p int32, from int64, n int, markAt int64, marker string) []Entry {
	out := make([]Entry, n)
	for i := range out {
		off := from + int64(i)
		val := fmt.Sprintf("%d/%d", p, off)
		if off == markAt {
			val = marker
		}
		key := fmt.Sprintf("p%d-k%d", p, off)
		e := Entry{
			Offset:   off,
			Record:   protocol.Record{Key: []byte(key), Value: []byte(val)},
			Schedule: protocol.Schedule{Target: "orders.created", BusinessKey: key, Ordered: true, Delay: time.Minute},
		}
		for j := range int(p) + 1 {
			e.Record.Headers = append(e.Record.Headers, hdr(fmt.Sprintf("h%d", j), fmt.Appendf(nil, "%d/%d/%d", p, off, j)))
		}
		out[i] = e
	}
	return out
}

// checkPartitionRows checks that partition p holds exactly the offsets
// [0, n), each with its own value and headers, and fresh seqs rising with
// the offset.
func checkPartitionRows(t *testing.T, pool *pgxpool.Pool, p int32, n int) {
	t.Helper()
	rows := readRows(t, pool, "m.source_partition = $1", p)
	if len(rows) != n {
		t.Fatalf("partition %d holds %d rows, want %d", p, len(rows), n)
	}
	var last int64
	for i, r := range rows {
		if r.Offset != int64(i) || string(r.Value) != fmt.Sprintf("%d/%d", p, i) {
			t.Fatalf("partition %d, row %d: offset %d, value %q", p, i, r.Offset, r.Value)
		}
		if r.Seq <= last {
			t.Fatalf("partition %d, offset %d: seq %d not above %d: seq does not follow offset order", p, r.Offset, r.Seq, last)
		}
		last = r.Seq
		if len(r.HeaderKeys) != int(p)+1 || string(r.HeaderValues[p]) != fmt.Sprintf("%d/%d/%d", p, i, p) {
			t.Fatalf("partition %d, offset %d: headers %q=%q: headers went to the wrong record", p, r.Offset, r.HeaderKeys, r.HeaderValues)
		}
	}
}

// TestStoreInsertBatches stores batches of several partitions in one
// statement: each is stored as Insert would store it alone, a batch whose
// position moved is not stored while the others are, and a malformed set
// of batches is refused with nothing stored.
func TestStoreInsertBatches(t *testing.T) {
	db := pgtest.NewDB(t)
	store := NewStore(db.Pool, nil)
	ctx := t.Context()

	// Partition 2 already has a position, at 5; partition 3 too, at 9, but
	// the writer believes it is at 4 (another writer stored past it).
	for _, pre := range []struct {
		p int32
		n int
	}{{2, 5}, {3, 9}} {
		if _, err := store.Insert(ctx, Position{Topic: storeTopic, Partition: pre.p, Next: NoPosition}, partEntries(pre.p, 0, pre.n, -1, "")); err != nil {
			t.Fatal(err)
		}
	}
	out, err := store.InsertBatches(ctx, []Batch{
		{Pos: Position{Topic: storeTopic, Partition: 1, Next: NoPosition}, Entries: partEntries(1, 0, 7, -1, "")},
		{Pos: Position{Topic: storeTopic, Partition: 3, Next: 4}, Entries: partEntries(3, 4, 3, -1, "")},
		{Pos: Position{Topic: storeTopic, Partition: 2, Next: 5}, Entries: partEntries(2, 5, 6, -1, "")},
		{Pos: Position{Topic: storeTopic, Partition: 0, Next: NoPosition}, Entries: partEntries(0, 0, 1, -1, "")},
	})
	if err != nil {
		t.Fatalf("InsertBatches: %v", err)
	}
	want := []struct {
		stored int64
		moved  bool
	}{{7, false}, {0, true}, {6, false}, {1, false}}
	for i, w := range want {
		if got := out[i]; got.Stored != w.stored || errors.Is(got.Err, ErrPositionMoved) != w.moved {
			t.Errorf("batch %d: stored %d, error %v; want stored %d, position moved %v", i, got.Stored, got.Err, w.stored, w.moved)
		}
	}
	if err := out[1].Err; err == nil || !strings.Contains(err.Error(), storeTopic+"/3 (offsets 4..6)") {
		t.Errorf("moved batch's error %q does not name its partition and offsets", err)
	}
	checkPartitionRows(t, db.Pool, 0, 1)
	checkPartitionRows(t, db.Pool, 1, 7)
	checkPartitionRows(t, db.Pool, 2, 11)
	checkPartitionRows(t, db.Pool, 3, 9)
	got, err := store.Positions(ctx, storeTopic, []int32{0, 1, 2, 3})
	if err != nil {
		t.Fatal(err)
	}
	for p, next := range map[int32]int64{0: 1, 1: 7, 2: 11, 3: 9} {
		if got[p].Next != next {
			t.Errorf("partition %d: stored position %d, want %d", p, got[p].Next, next)
		}
	}

	before := countRows(t, db.Pool)
	for _, tc := range []struct {
		name    string
		batches []Batch
		want    string
	}{
		{"two batches of one partition", []Batch{
			{Pos: Position{Topic: storeTopic, Partition: 5, Next: NoPosition}, Entries: partEntries(5, 0, 1, -1, "")},
			{Pos: Position{Topic: storeTopic, Partition: 5, Next: 1}, Entries: partEntries(5, 1, 1, -1, "")},
		}, "two batches of partition 5"},
		{"two topics", []Batch{
			{Pos: Position{Topic: storeTopic, Partition: 5, Next: NoPosition}, Entries: partEntries(5, 0, 1, -1, "")},
			{Pos: Position{Topic: "other", Partition: 6, Next: NoPosition}, Entries: partEntries(6, 0, 1, -1, "")},
		}, "one topic only"},
		{"an empty batch", []Batch{
			{Pos: Position{Topic: storeTopic, Partition: 5, Next: NoPosition}, Entries: partEntries(5, 0, 1, -1, "")},
			{Pos: Position{Topic: storeTopic, Partition: 6, Next: NoPosition}},
		}, "an empty batch of partition 6"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := store.InsertBatches(ctx, tc.batches); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("InsertBatches: %v, want an error saying %q", err, tc.want)
			}
			if n := countRows(t, db.Pool); n != before {
				t.Fatalf("%d rows after a refused call, want %d", n, before)
			}
		})
	}
}

// holdSlots fills every slot of w, so that batches queue, and returns the
// function that frees them.
func holdSlots(w *writer) func() {
	for range cap(w.slots) {
		w.slots <- struct{}{}
	}
	return func() {
		for range cap(w.slots) {
			<-w.slots
		}
	}
}

// queued waits until n batches wait in w.
func queued(t *testing.T, w *writer, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		w.mu.Lock()
		got := len(w.queue)
		w.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d batches queued after 10 s, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

type insertResult struct {
	p   int32
	n   Inserted
	err error
}

// insertAll inserts, from one goroutine per partition, each partition's
// entries after no stored position, and returns a channel of the results.
func insertAll(ctx context.Context, w *writer, batches map[int32][]Entry) <-chan insertResult {
	out := make(chan insertResult, len(batches))
	var wg sync.WaitGroup
	for p, entries := range batches {
		wg.Go(func() {
			n, err := w.insert(ctx, Position{Topic: storeTopic, Partition: p, Next: NoPosition}, entries)
			out <- insertResult{p, n, err}
		})
	}
	go func() { wg.Wait(); close(out) }()
	return out
}

// TestWriterCombines checks that batches of several partitions that wait
// for a busy writer go in one statement, and that each caller gets its own
// batch's counts.
func TestWriterCombines(t *testing.T) {
	db := pgtest.NewDB(t)
	w := newWriter(NewStore(db.Pool, nil), 1, 1000, 0)
	release := holdSlots(w)
	batches := map[int32][]Entry{}
	for p := range int32(5) {
		batches[p] = partEntries(p, 0, int(p)+2, -1, "")
	}
	results := insertAll(t.Context(), w, batches)
	queued(t, w, len(batches))
	release()
	for r := range results {
		if r.err != nil || r.n.Stored != int64(len(batches[r.p])) {
			t.Errorf("partition %d: stored %d, %v; want %d", r.p, r.n.Stored, r.err, len(batches[r.p]))
		}
	}
	if s, b := w.statements.Load(), w.batches.Load(); s != 1 || b != 5 {
		t.Errorf("%d statements for %d batches, want 1 for 5", s, b)
	}
	for p := range int32(5) {
		checkPartitionRows(t, db.Pool, p, int(p)+2)
	}
}

// TestWriterPoisonFallsBack checks that when the database refuses a
// combined statement for one batch's record, the other batches are stored
// each alone and only that batch's caller gets the refusal (its claim then
// stores the batch record by record: TestIngestPoisonBatch).
func TestWriterPoisonFallsBack(t *testing.T) {
	db := pgtest.NewDB(t)
	poisonTrigger(t.Context(), t, db.Pool.Exec, "poison", false)
	w := newWriter(NewStore(db.Pool, nil), 1, 1000, 0)
	release := holdSlots(w)
	batches := map[int32][]Entry{
		0: partEntries(0, 0, 3, -1, ""),
		1: partEntries(1, 0, 4, 2, "poison"),
		2: partEntries(2, 0, 5, -1, ""),
	}
	results := insertAll(t.Context(), w, batches)
	queued(t, w, len(batches))
	release()
	for r := range results {
		if r.p == 1 {
			if r.err == nil || !poison(r.err) || r.n.Stored != 0 {
				t.Errorf("partition 1: stored %d, %v; want the database's refusal", r.n.Stored, r.err)
			}
			continue
		}
		if r.err != nil || r.n.Stored != int64(len(batches[r.p])) {
			t.Errorf("partition %d: stored %d, %v; want %d", r.p, r.n.Stored, r.err, len(batches[r.p]))
		}
	}
	if s := w.statements.Load(); s != 4 {
		t.Errorf("%d statements, want 4: the combined one, then one per batch", s)
	}
	checkPartitionRows(t, db.Pool, 0, 3)
	checkPartitionRows(t, db.Pool, 1, 0)
	checkPartitionRows(t, db.Pool, 2, 5)
}

// TestWriterTake checks which waiting batches go in the next statement.
func TestWriterTake(t *testing.T) {
	req := func(p int32, records int, bytes int64) *writeRequest {
		return &writeRequest{batch: Batch{Pos: Position{Partition: p}, Entries: make([]Entry, records)}, bytes: bytes}
	}
	for _, tc := range []struct {
		name       string
		maxRecords int
		maxBytes   int64
		queue      []*writeRequest
		want, left []int32 // partitions taken, and left waiting, in order
	}{
		{"all fit", 1000, 0, []*writeRequest{req(0, 10, 1), req(1, 20, 1), req(2, 30, 1)}, []int32{0, 1, 2}, nil},
		{"records bound", 100, 0, []*writeRequest{req(0, 40, 1), req(1, 40, 1), req(2, 40, 1), req(3, 10, 1)},
			[]int32{0, 1}, []int32{2, 3}},
		{"exactly the bound", 100, 0, []*writeRequest{req(0, 60, 1), req(1, 40, 1)}, []int32{0, 1}, nil},
		{"bytes bound", 1000, 100, []*writeRequest{req(0, 1, 60), req(1, 1, 60), req(2, 1, 10)}, []int32{0}, []int32{1, 2}},
		{"a first batch over the bounds goes alone", 10, 10, []*writeRequest{req(0, 50, 500), req(1, 1, 1)},
			[]int32{0}, []int32{1}},
		{"a second batch of a partition waits", 1000, 0, []*writeRequest{req(0, 1, 1), req(0, 1, 1), req(1, 1, 1)},
			[]int32{0, 1}, []int32{0}},
		{"nothing waits", 1000, 0, nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWriter(nil, 1, tc.maxRecords, tc.maxBytes)
			w.queue = tc.queue
			parts := func(rs []*writeRequest) []int32 {
				var out []int32
				for _, r := range rs {
					out = append(out, r.batch.Pos.Partition)
				}
				return out
			}
			if got := parts(w.take()); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("took partitions %v, want %v", got, tc.want)
			}
			if got := parts(w.queue); fmt.Sprint(got) != fmt.Sprint(tc.left) {
				t.Errorf("left partitions %v waiting, want %v", got, tc.left)
			}
		})
	}
}
