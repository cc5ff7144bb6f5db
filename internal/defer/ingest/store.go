package ingest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/highwater"
	"github.com/deferq/scheduler/sql/queries"
)

// Entry is one record of the defer topic ready to store: its offset, the
// record itself, and what parsing it said.
type Entry struct {
	Offset   int64
	Record   protocol.Record
	Schedule protocol.Schedule
	// Reject is set when the record cannot be scheduled; it is then stored as
	// state 'rejected' with Reject.Error() as the reason, and Decision is
	// ignored.
	Reject *protocol.RejectError
	// Decision is what the retry rules made of a record that was not
	// rejected: pending or parked, the policy's delay, and the key and
	// dead-letter settings for when it is parked.
	Decision protocol.Decision
}

// NoPosition is Position.Next for a partition with no stored position: it
// was never ingested, or the database went back to before it was.
const NoPosition int64 = -1

// Position is where ingest stands in one partition of the defer topic: the
// next offset to read and the partition's epoch, which is bumped when the
// partition is found re-created or truncated (migration 0005), so that a
// record at an offset reused by Kafka is not taken for one stored before.
type Position struct {
	Topic     string
	Partition int32
	Epoch     int32
	// Next is the next offset to read, or NoPosition.
	Next int64
}

// StoredPosition is a Position as read from the database, with the topic id
// it was set under ("" when none is known).
type StoredPosition struct {
	Position
	TopicID string
}

// ErrPositionMoved is returned, wrapped, by Insert and SetPosition when the
// stored position is not the one the caller gave: the database went back in
// time, or another writer stored past it. Nothing was written.
var ErrPositionMoved = errors.New("the stored ingest position moved")

// Inserted counts what one Insert stored.
type Inserted struct {
	// Stored counts the new rows; the rest of the batch was stored before.
	Stored int64
	// Rejected and Parked count the new rows stored in those states.
	Rejected, Parked int64
	// Gated counts the new rows stored pending behind a blocked key
	// (defer.gated).
	Gated int64
}

// Store writes batches of entries to deferred_message.
type Store struct {
	pool  *pgxpool.Pool
	marks *highwater.Marks
}

// NewStore returns a Store on pool.
//
// marks (nil: none) are the highest id and seq the process has seen: each
// Insert moves the sequences past them first, if a database that went back
// in time left them behind, and raises them to what it stored.
func NewStore(pool *pgxpool.Pool, marks *highwater.Marks) *Store {
	return &Store{pool: pool, marks: marks}
}

// Insert stores the entries read from one partition after pos in one
// transaction (see InsertBatches), together with the partition's next
// offset (the last entry's plus one), and returns how many were new, and how
// many of those were rejected and parked. The write checks that the
// partition's stored position is still pos: if not, it stores nothing and
// Insert returns an error wrapping ErrPositionMoved. Entries stored before
// (the same topic, partition, epoch and offset) are skipped. Entries must be
// in offset order.
//
// Rejected and parked rows are due at ingest time: they are never sent on
// their own, and an operator who sets one back to pending usually wants it
// now.
func (s *Store) Insert(ctx context.Context, pos Position, entries []Entry) (Inserted, error) {
	if len(entries) == 0 {
		return Inserted{}, nil
	}
	out, err := s.InsertBatches(ctx, []Batch{{Pos: pos, Entries: entries}})
	if err != nil {
		return Inserted{}, err
	}
	return out[0].Inserted, out[0].Err
}

// Batch is the entries read from one partition after Pos, in offset order.
type Batch struct {
	Pos     Position
	Entries []Entry
}

// BatchResult is what InsertBatches did with one batch: what it stored, or
// an error wrapping ErrPositionMoved when the batch's position did not match
// (nothing of that batch was stored).
type BatchResult struct {
	Inserted
	Err error
}

// InsertBatches stores batches of one topic's partitions, at most one batch
// per partition and none empty, in one transaction, each as Insert would:
// a batch whose position does not match is not stored and its result says
// so, and the others are stored all the same. Several small batches cost
// much less stored together than one by one: a statement's fixed cost (its
// triggers' statements) is paid once. An error (the database refused the
// batches, or did not answer) is for all of them: nothing was stored, or,
// if the answer was lost after the commit, everything that matched.
//
// From copyMinRecords records on, the rows go in with COPY
// (ingest_prepare.sql, then queries.IngestCopy), which costs Postgres about
// a third less than the INSERT statement (ingest_insert.sql) that stores
// fewer. COPY has no ON CONFLICT, so when a record was stored before, a
// safety net now that positions are checked, the COPY fails whole, nothing
// of it stays, and the batches go again through the statement, which skips
// what is stored.
func (s *Store) InsertBatches(ctx context.Context, batches []Batch) ([]BatchResult, error) {
	if len(batches) == 0 {
		return nil, nil
	}
	topic := batches[0].Pos.Topic
	n, parts := 0, make(map[int32]bool, len(batches))
	for _, b := range batches {
		switch {
		case b.Pos.Topic != topic:
			return nil, fmt.Errorf("store batches of %s and %s in one statement: one topic only", topic, b.Pos.Topic)
		case parts[b.Pos.Partition]:
			return nil, fmt.Errorf("store batches of %s: two batches of partition %d in one statement", topic, b.Pos.Partition)
		case len(b.Entries) == 0:
			return nil, fmt.Errorf("store batches of %s: an empty batch of partition %d", topic, b.Pos.Partition)
		}
		parts[b.Pos.Partition] = true
		n += len(b.Entries)
	}
	if n < copyMinRecords {
		return s.insertBatches(ctx, topic, n, batches)
	}
	out, err := s.copyBatches(ctx, topic, batches)
	if pg := (*pgconn.PgError)(nil); errors.As(err, &pg) && pg.Code == pgerrcode.UniqueViolation {
		return s.insertBatches(ctx, topic, n, batches)
	}
	return out, err
}

// copyMinRecords is the fewest records InsertBatches stores with COPY.
// COPY takes five round trips (begin, the statement before it, the COPY's
// two, the commit) where the INSERT statement takes one, which a small
// batch feels: in BenchmarkStoreInsert a lone batch of 6 took 0.3 ms longer
// by COPY (320-340 against 232-246 µs per record), one of 50 was a tenth
// quicker (89-93 against 96-105), one of 1,000 a third (48-49 against
// 71-75; docs/benchmarks.md, "Ingest by COPY").
const copyMinRecords = 50

// copyBatches stores batches with COPY in one transaction: the statement
// before it checks the positions and draws the ids and seqs
// (ingest_prepare.sql), then the matched batches' rows are copied with
// every column the INSERT statement would have written.
func (s *Store) copyBatches(ctx context.Context, topic string, batches []Batch) ([]BatchResult, error) {
	p := queries.IngestPrepareParams{
		Topic:       topic,
		Partitions:  make([]int32, len(batches)),
		NextOffsets: make([]int64, len(batches)),
		Expected:    make([]int64, len(batches)),
		Epochs:      make([]int32, len(batches)),
		Records:     make([]int32, len(batches)),
		FreshSeqs:   make([]int32, len(batches)),
	}
	for k, b := range batches {
		p.Partitions[k] = b.Pos.Partition
		p.NextOffsets[k] = b.Entries[len(b.Entries)-1].Offset + 1
		p.Expected[k] = b.Pos.Next
		p.Epochs[k] = b.Pos.Epoch
		p.Records[k] = int32(len(b.Entries))
		for j := range b.Entries {
			if b.Entries[j].Schedule.Seq <= 0 {
				p.FreshSeqs[k]++
			}
		}
	}
	p.MinID, p.MinSeq = s.marks.Get()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("store %s: %w", describe(batches), err)
	}
	// After a commit, Rollback does nothing.
	defer tx.Rollback(context.WithoutCancel(ctx))
	prep, err := queries.IngestPrepare(ctx, tx, p)
	if err != nil {
		return nil, fmt.Errorf("store %s: %w", describe(batches), err)
	}
	src := &copySource{topic: topic, batches: batches, prep: prep, out: make([]BatchResult, len(batches)),
		maxID: make([]int64, len(batches)), maxSeq: make([]int64, len(batches)), k: -1}
	for k, b := range batches {
		if !slices.Contains(prep.Matched, b.Pos.Partition) {
			src.out[k].Err = fmt.Errorf("store %s after %s: %w", describe(batches[k:k+1]), b.Pos, ErrPositionMoved)
		}
	}
	if len(prep.IDs) > 0 {
		if _, err := queries.IngestCopy(ctx, tx, src); err != nil {
			return nil, fmt.Errorf("store %s: %w", describe(batches), err)
		}
		// Every id and fresh seq drawn went to a row: the statement drew
		// them for exactly the matched batches' records.
		if src.id != len(prep.IDs) || src.seq != len(prep.Seqs) {
			return nil, fmt.Errorf("store %s: copied rows took %d ids and %d seqs of the %d and %d drawn",
				describe(batches), src.id, src.seq, len(prep.IDs), len(prep.Seqs))
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("store %s: commit: %w", describe(batches), err)
	}
	for k := range src.out {
		if src.out[k].Err == nil && src.maxID[k] > 0 {
			s.marks.Observe(src.maxID[k], src.maxSeq[k])
		}
	}
	return src.out, nil
}

// copySource hands COPY the rows of the matched batches, in the order the
// batches were given and in offset order within each, taking the ids and
// fresh seqs in the order ingest_prepare.sql drew them, and counts what
// each batch stored as the INSERT statement reports it.
//
// Values are handed over as they are, not as pointers: pgx encodes a
// pointer by dereferencing it through reflection, which costs more than
// boxing the value. pgx encodes a row before it asks for the next, so the
// header arrays' backing stores serve every row in turn.
type copySource struct {
	topic   string
	batches []Batch
	prep    queries.IngestPrepareRow
	out     []BatchResult
	// maxID and maxSeq per batch, for the high-water marks.
	maxID, maxSeq []int64
	k, j          int // the current batch and entry
	id, seq       int // the next id and fresh seq to take
	keysBuf       []string
	valuesBuf     pgtype.FlatArray[[]byte]
	row           [25]any
}

// Next moves to the next entry of a matched batch.
func (c *copySource) Next() bool {
	c.j++
	for c.k < len(c.batches) {
		if c.k >= 0 && c.out[c.k].Err == nil && c.j < len(c.batches[c.k].Entries) {
			return true
		}
		c.k++
		c.j = 0
	}
	return false
}

// Values returns the current entry's row, in queries.IngestCopyColumns()
// order, with what ingest_insert.sql would have stored.
func (c *copySource) Values() ([]any, error) {
	b := &c.batches[c.k]
	e := &b.Entries[c.j]
	sc := &e.Schedule
	if c.id >= len(c.prep.IDs) {
		return nil, fmt.Errorf("more rows than the %d ids drawn", len(c.prep.IDs))
	}
	id := c.prep.IDs[c.id]
	c.id++
	seq := sc.Seq
	if seq <= 0 {
		if c.seq >= len(c.prep.Seqs) {
			return nil, fmt.Errorf("more new rows than the %d seqs drawn", len(c.prep.Seqs))
		}
		seq = c.prep.Seqs[c.seq]
		c.seq++
	}
	c.maxID[c.k] = max(c.maxID[c.k], id)
	c.maxSeq[c.k] = max(c.maxSeq[c.k], seq)
	r := &c.row
	*r = [25]any{}
	r[0], r[1], r[2], r[3], r[4] = id, c.topic, b.Pos.Partition, b.Pos.Epoch, e.Offset
	if sc.Ordered {
		r[5] = sc.BusinessKey
	}
	r[6] = seq
	if sc.Target != "" {
		r[7] = sc.Target
	}
	// next_run_at as the statement computes it: the transaction's now()
	// plus the delay in whole microseconds.
	now := c.prep.Now
	switch {
	case e.Reject != nil, e.Decision.Park != nil:
		r[8] = now
	case sc.HasAt:
		r[8] = sc.At
	default:
		r[8] = now.Add(e.delay().Truncate(time.Microsecond))
	}
	r[9] = sc.Attempt
	res := &c.out[c.k].Inserted
	res.Stored++
	switch {
	case e.Reject != nil:
		r[10], r[11] = "rejected", e.Reject.Error()
		res.Rejected++
	case e.Decision.Park != nil:
		r[10], r[11], r[20] = "parked", e.Decision.Park.String(), now
		res.Parked++
	default:
		r[10] = "pending"
		if sc.Gated {
			res.Gated++
		}
	}
	// A rejected row holds nothing and has no policy.
	holds := false
	if e.Reject == nil {
		holds = !e.Decision.ReleaseKey
		if e.Decision.DLQTopic != "" {
			r[21] = e.Decision.DLQTopic
		}
	}
	if sc.ErrorClass != "" {
		r[12] = sc.ErrorClass
	}
	if sc.ErrorMessage != "" {
		r[13] = sc.ErrorMessage
	}
	if sc.OriginID > 0 {
		r[14] = sc.OriginID
	}
	// A nil key or value is NULL; an empty one is stored empty.
	if e.Record.Key != nil {
		r[15] = e.Record.Key
	}
	if e.Record.Value != nil {
		r[16] = e.Record.Value
	}
	if c.keysBuf == nil {
		// header_keys and header_values are NOT NULL: a record without
		// headers stores empty arrays, never nil ones.
		c.keysBuf, c.valuesBuf = make([]string, 0, 8), make(pgtype.FlatArray[[]byte], 0, 8)
	}
	keys, values := c.keysBuf[:0], c.valuesBuf[:0]
	for _, h := range e.Record.Headers {
		// A header key that is not text was rejected by Parse; it is still
		// stored, in \x hex form, so nothing is lost.
		keys = append(keys, protocol.Text(h.Key))
		values = append(values, h.Value)
	}
	c.keysBuf, c.valuesBuf = keys, values
	r[17], r[18], r[19] = keys, values, holds
	r[22] = sc.RedriveCount
	if sc.Group != "" {
		r[23] = sc.Group
	}
	r[24] = sc.Gated
	return r[:], nil
}

// Err is nil: Values reports its own errors.
func (c *copySource) Err() error { return nil }

// insertBatches stores batches with the INSERT statement
// (ingest_insert.sql), which skips records stored before.
func (s *Store) insertBatches(ctx context.Context, topic string, n int, batches []Batch) ([]BatchResult, error) {
	// The per-record arrays are filled in place; queries.IngestInsertParams
	// says why some are pgtype.FlatArray.
	var (
		partitions = make([]int32, 0, len(batches))
		nexts      = make([]int64, 0, len(batches))
		expected   = make([]int64, 0, len(batches))
		epochs     = make([]int32, 0, len(batches))
		recParts   = make([]int32, n)
		offsets    = make([]int64, n)
		bizKeys    = make(pgtype.FlatArray[*string], n)
		seqs       = make(pgtype.FlatArray[*int64], n)
		targets    = make(pgtype.FlatArray[*string], n)
		runAts     = make(pgtype.FlatArray[*time.Time], n)
		delays     = make([]int64, n)
		attempts   = make([]int32, n)
		states     = make([]string, n)
		reasons    = make(pgtype.FlatArray[*string], n)
		classes    = make(pgtype.FlatArray[*string], n)
		messages   = make(pgtype.FlatArray[*string], n)
		origins    = make(pgtype.FlatArray[*int64], n)
		keys       = make(pgtype.FlatArray[[]byte], n)
		values     = make(pgtype.FlatArray[[]byte], n)
		hRecord    []int32
		hKeys      []string
		hValues    pgtype.FlatArray[[]byte]
		holds      = make([]bool, n)
		dlqs       = make(pgtype.FlatArray[*string], n)
		redrives   = make([]int32, n)
		groups     = make(pgtype.FlatArray[*string], n)
		gated      = make([]bool, n)
	)
	i := 0
	for _, b := range batches {
		partitions = append(partitions, b.Pos.Partition)
		nexts = append(nexts, b.Entries[len(b.Entries)-1].Offset+1)
		expected = append(expected, b.Pos.Next)
		epochs = append(epochs, b.Pos.Epoch)
		for j := range b.Entries {
			e := &b.Entries[j]
			sc := &e.Schedule
			recParts[i] = b.Pos.Partition
			offsets[i] = e.Offset
			if sc.Ordered {
				bizKeys[i] = &sc.BusinessKey
			}
			if sc.Seq > 0 {
				seqs[i] = &sc.Seq
			}
			if sc.Target != "" {
				targets[i] = &sc.Target
			}
			switch {
			case e.Reject != nil, e.Decision.Park != nil:
				// Never dispatched on their own: next_run_at is ingest time.
			case sc.HasAt:
				runAts[i] = &sc.At
			default:
				delays[i] = e.delay().Microseconds()
			}
			attempts[i] = sc.Attempt
			switch {
			case e.Reject != nil:
				// A rejected row holds nothing and has no policy: an operator
				// who fixes it decides what becomes of it.
				states[i] = "rejected"
				reason := e.Reject.Error()
				reasons[i] = &reason
			default:
				states[i] = "pending"
				if e.Decision.Park != nil {
					states[i] = "parked"
					reason := e.Decision.Park.String()
					reasons[i] = &reason
				}
				holds[i] = !e.Decision.ReleaseKey
				if e.Decision.DLQTopic != "" {
					dlqs[i] = &e.Decision.DLQTopic
				}
			}
			redrives[i] = sc.RedriveCount
			if sc.Group != "" {
				groups[i] = &sc.Group
			}
			gated[i] = sc.Gated
			if sc.ErrorClass != "" {
				classes[i] = &sc.ErrorClass
			}
			if sc.ErrorMessage != "" {
				messages[i] = &sc.ErrorMessage
			}
			if sc.OriginID > 0 {
				origins[i] = &sc.OriginID
			}
			keys[i] = e.Record.Key
			values[i] = e.Record.Value
			for _, h := range e.Record.Headers {
				hRecord = append(hRecord, int32(i+1))
				// A header key that is not text was rejected by Parse; it is still
				// stored, in \x hex form, so nothing is lost.
				hKeys = append(hKeys, protocol.Text(h.Key))
				hValues = append(hValues, h.Value)
			}
			i++
		}
	}
	minID, minSeq := s.marks.Get()
	rows, err := queries.IngestInsert(ctx, s.pool, queries.IngestInsertParams{
		Topic: topic, Partitions: partitions, Offsets: offsets, BusinessKeys: bizKeys, Seqs: seqs, Targets: targets,
		RunAts: runAts, DelaysMicros: delays, Attempts: attempts, States: states, Reasons: reasons,
		ErrorClasses: classes, ErrorMessages: messages, OriginIDs: origins, Keys: keys, Values: values,
		HeaderRecords: hRecord, HeaderKeys: hKeys, HeaderValues: hValues, NextOffsets: nexts,
		HoldsKey: holds, DLQTopics: dlqs, RedriveCounts: redrives, Expected: expected, Epochs: epochs,
		MinID: minID, MinSeq: minSeq, Groups: groups, Gated: gated, RecordPartitions: recParts,
	})
	if err != nil {
		return nil, fmt.Errorf("store %s: %w", describe(batches), err)
	}
	byPartition := make(map[int32]queries.IngestInsertRow, len(rows))
	for _, r := range rows {
		byPartition[r.Partition] = r
	}
	out := make([]BatchResult, len(batches))
	for k, b := range batches {
		r, ok := byPartition[b.Pos.Partition]
		switch {
		case !ok:
			// The statement returns a row per batch; this would be a bug in it.
			return nil, fmt.Errorf("store %s: no result for partition %d", describe(batches), b.Pos.Partition)
		case !r.Matched:
			out[k].Err = fmt.Errorf("store %s after %s: %w", describe(batches[k:k+1]), b.Pos, ErrPositionMoved)
			continue
		}
		if r.MaxID != nil && r.MaxSeq != nil {
			s.marks.Observe(*r.MaxID, *r.MaxSeq)
		}
		out[k].Inserted = Inserted{Stored: r.Stored, Rejected: r.Rejected, Parked: r.Parked, Gated: r.Gated}
	}
	return out, nil
}

// describe names batches for errors: "7 records of t/3 (offsets 10..16)",
// or, for several, "12 records of t: 3 (offsets 10..16), 5 (offsets 7..11)".
func describe(batches []Batch) string {
	n := 0
	for _, b := range batches {
		n += len(b.Entries)
	}
	first := batches[0]
	if len(batches) == 1 {
		return fmt.Sprintf("%d records of %s/%d (offsets %d..%d)", n, first.Pos.Topic, first.Pos.Partition,
			first.Entries[0].Offset, first.Entries[len(first.Entries)-1].Offset)
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d records of %s: ", n, first.Pos.Topic)
	for k, b := range batches {
		if k > 0 {
			sb.WriteString(", ")
		}
		fmt.Fprintf(&sb, "%d (offsets %d..%d)", b.Pos.Partition, b.Entries[0].Offset, b.Entries[len(b.Entries)-1].Offset)
	}
	return sb.String()
}

// String renders pos for logs and errors.
func (pos Position) String() string {
	if pos.Next == NoPosition {
		return fmt.Sprintf("no stored position (epoch %d)", pos.Epoch)
	}
	return fmt.Sprintf("position %d (epoch %d)", pos.Next, pos.Epoch)
}

// Positions returns the stored positions of the given partitions of topic;
// a partition never ingested is absent.
func (s *Store) Positions(ctx context.Context, topic string, partitions []int32) (map[int32]StoredPosition, error) {
	rows, err := queries.IngestPositions(ctx, s.pool, queries.IngestPositionsParams{Topic: topic, Partitions: partitions})
	if err != nil {
		return nil, fmt.Errorf("read ingest positions of %s: %w", topic, err)
	}
	out := make(map[int32]StoredPosition, len(rows))
	for _, r := range rows {
		p := StoredPosition{Position: Position{Topic: topic, Partition: r.Partition, Next: r.NextOffset, Epoch: r.Epoch}}
		if r.TopicID != nil {
			p.TopicID = *r.TopicID
		}
		out[p.Partition] = p
	}
	return out, nil
}

// SetPosition moves the stored position of from's partition to to, with
// topicID ("" for none), if it is still from (from.Next == NoPosition: none
// stored). It returns an error wrapping ErrPositionMoved if it was not.
func (s *Store) SetPosition(ctx context.Context, from, to Position, topicID string) error {
	var id *string
	if topicID != "" {
		id = &topicID
	}
	row, err := queries.IngestPositionSet(ctx, s.pool, queries.IngestPositionSetParams{
		Topic: from.Topic, Partition: from.Partition, FromNext: from.Next, FromEpoch: from.Epoch,
		ToNext: to.Next, ToEpoch: to.Epoch, TopicID: id,
	})
	if err != nil {
		return fmt.Errorf("set the ingest position of %s/%d to %s: %w", from.Topic, from.Partition, to, err)
	}
	if !row.Moved {
		return fmt.Errorf("set the ingest position of %s/%d from %s to %s: %w", from.Topic, from.Partition, from, to, ErrPositionMoved)
	}
	return nil
}
