package ingest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

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
// statement (so in one transaction), together with the partition's next
// offset (the last entry's plus one), and returns how many were new, and how
// many of those were rejected and parked. The statement checks that the
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
// per partition and none empty, in one statement, each as Insert would:
// a batch whose position does not match is not stored and its result says
// so, and the others are stored all the same. Several small batches cost
// much less stored together than one by one: a statement's fixed cost (its
// triggers' statements) is paid once. An error (the database refused the
// statement, or did not answer) is for all of them: nothing was stored, or,
// if the answer was lost after the commit, everything that matched.
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
			case sc.FromPolicy:
				delays[i] = e.Decision.Delay.Microseconds()
			default:
				delays[i] = sc.Delay.Microseconds()
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
