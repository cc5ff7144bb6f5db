package ingest

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// writer stores the batches of every partition an Ingester consumes, with
// at most a fixed number of insert statements running at once (its slots).
// A "statement" here is one Store.InsertBatches: a COPY in its own
// transaction from copyMinRecords records on, the INSERT statement below.
// A batch that comes while every slot is busy waits, and goes in the next
// statement together with every other batch that waited meanwhile, up to
// one batch's bounds (maxRecords, maxBytes): group commit. A batch that
// finds a slot free goes at once, alone, so combining costs no latency; it
// only happens when the database is the bottleneck, which is when it pays.
//
// Why: each partition's claim writes its own batches, and a statement has a
// fixed cost (its statement-level triggers run their own statements) that a
// small batch pays in full, several times what a record costs in a full
// batch (BenchmarkStoreInsert; docs/benchmarks.md, "Partitions and ingest's
// writers"). A live stream over 64 partitions makes many small batches,
// each cut by the linger rather than the batch size.
type writer struct {
	store      *Store
	slots      chan struct{}
	maxRecords int
	maxBytes   int64 // 0: no bound

	mu    sync.Mutex
	queue []*writeRequest

	// statements and batches count what was written (the tests read them).
	statements, batches atomic.Int64
	// running is the number of statements under way.
	running atomic.Int32
}

// writeRequest is one batch waiting for a statement, and where its result
// goes (buffered: the writer never waits for the caller).
type writeRequest struct {
	batch Batch
	bytes int64
	done  chan writeResult
}

type writeResult struct {
	Inserted
	err error
}

// statementTimeout bounds one insert statement. It runs to its end even if
// the session ends meanwhile: a write cancelled after it reached Postgres
// would commit rows whose offsets then go unmarked.
const statementTimeout = 30 * time.Second

func newWriter(store *Store, slots, maxRecords int, maxBytes int64) *writer {
	return &writer{store: store, slots: make(chan struct{}, max(1, slots)), maxRecords: max(1, maxRecords),
		maxBytes: max(0, maxBytes)}
}

// insert stores entries, read from pos's partition after pos, as
// Store.Insert does, alone or together with other partitions' batches, and
// returns what it stored. The caller that gets a free slot writes whatever
// waits, its own batch and others', so no goroutine runs apart from the
// callers.
func (w *writer) insert(ctx context.Context, pos Position, entries []Entry) (Inserted, error) {
	if len(entries) == 0 {
		return Inserted{}, nil
	}
	r := &writeRequest{batch: Batch{Pos: pos, Entries: entries}, bytes: entriesBytes(entries), done: make(chan writeResult, 1)}
	w.mu.Lock()
	w.queue = append(w.queue, r)
	w.mu.Unlock()
	for {
		select {
		case res := <-r.done:
			return res.Inserted, res.err
		case w.slots <- struct{}{}:
			group := w.take()
			if len(group) > 0 {
				w.write(ctx, group)
			}
			<-w.slots
			if len(group) == 0 {
				// Nothing waited, so this batch is in another caller's
				// statement (or already answered).
				res := <-r.done
				return res.Inserted, res.err
			}
		}
	}
}

// take removes and returns the batches for the next statement: the
// longest run of waiting batches, first come first, that stays within
// maxRecords and maxBytes (the first one always, whatever its size), one
// batch per partition.
func (w *writer) take() []*writeRequest {
	w.mu.Lock()
	defer w.mu.Unlock()
	var group, rest []*writeRequest
	records, bytes := 0, int64(0)
	parts := make(map[int32]bool)
	full := false
	for _, r := range w.queue {
		n := len(r.batch.Entries)
		fits := len(group) == 0 ||
			(records+n <= w.maxRecords && (w.maxBytes == 0 || bytes+r.bytes <= w.maxBytes))
		if full || !fits || parts[r.batch.Pos.Partition] {
			// Another batch of a partition already in the group cannot be
			// (a claim waits for its batch), but if it were, it goes next.
			full = full || !fits
			rest = append(rest, r)
			continue
		}
		group = append(group, r)
		parts[r.batch.Pos.Partition] = true
		records += n
		bytes += r.bytes
	}
	clear(w.queue) // no batch kept alive by the backing array
	w.queue = append(w.queue[:0], rest...)
	return group
}

// idle reports whether no statement runs and no batch waits for one: a
// batch written now goes at once, alone, and makes no other batch wait.
func (w *writer) idle() bool {
	if w.running.Load() > 0 {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.queue) == 0
}

// write stores group in one statement and answers each batch. When the
// database refuses the statement for its data (see poison), each batch is
// written again alone, so that one partition's bad record fails only that
// partition's batch, whose caller then finds the record (storeEach). Any
// other error is every batch's: each caller retries as for a batch of its
// own.
func (w *writer) write(ctx context.Context, group []*writeRequest) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementTimeout)
	defer cancel()
	batches := make([]Batch, len(group))
	for i, r := range group {
		batches[i] = r.batch
	}
	w.statements.Add(1)
	w.batches.Add(int64(len(group)))
	w.running.Add(1)
	defer w.running.Add(-1)
	out, err := w.store.InsertBatches(sctx, batches)
	if err != nil && len(group) > 1 && poison(err) {
		for _, r := range group {
			w.statements.Add(1)
			n, err := w.store.Insert(sctx, r.batch.Pos, r.batch.Entries)
			r.done <- writeResult{Inserted: n, err: err}
		}
		return
	}
	for i, r := range group {
		if err != nil {
			r.done <- writeResult{err: err}
			continue
		}
		r.done <- writeResult{Inserted: out[i].Inserted, err: out[i].Err}
	}
}

// entriesBytes is what entries count against a batch's bytes, as
// recordBytes counts the records they were read from.
func entriesBytes(entries []Entry) int64 {
	var n int64
	for i := range entries {
		rec := &entries[i].Record
		n += int64(len(rec.Key) + len(rec.Value) + recordOverhead)
		for _, h := range rec.Headers {
			n += int64(len(h.Key) + len(h.Value))
		}
	}
	return n
}
