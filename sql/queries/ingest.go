package queries

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// IngestInsertParams are ingest_insert.sql's parameters: one batch from each
// of one or more partitions of Topic. The per-batch fields have one element
// per batch, the per-record fields one element per record, the records of
// a batch together and in offset order; the header arrays list every header
// with the 1-based position of its record in HeaderRecords. Slices of
// pointers and of []byte are pgtype.FlatArray: pgx encodes slice types it
// has no fast path for through reflection, and the generic path costs about
// a third less CPU per batch (BenchmarkStoreInsert). Nil elements are NULL.
type IngestInsertParams struct {
	Topic            string                       // $1
	Partitions       []int32                      // $2, per batch
	Offsets          []int64                      // $3
	BusinessKeys     pgtype.FlatArray[*string]    // $4, NULL: unordered
	Seqs             pgtype.FlatArray[*int64]     // $5, NULL: a fresh seq
	Targets          pgtype.FlatArray[*string]    // $6
	RunAts           pgtype.FlatArray[*time.Time] // $7, NULL: now() + DelaysMicros
	DelaysMicros     []int64                      // $8
	Attempts         []int32                      // $9
	States           []string                     // $10
	Reasons          pgtype.FlatArray[*string]    // $11
	ErrorClasses     pgtype.FlatArray[*string]    // $12
	ErrorMessages    pgtype.FlatArray[*string]    // $13
	OriginIDs        pgtype.FlatArray[*int64]     // $14
	Keys             pgtype.FlatArray[[]byte]     // $15
	Values           pgtype.FlatArray[[]byte]     // $16
	HeaderRecords    []int32                      // $17
	HeaderKeys       []string                     // $18
	HeaderValues     pgtype.FlatArray[[]byte]     // $19
	NextOffsets      []int64                      // $20, per batch: the partition's next offset once stored
	HoldsKey         []bool                       // $21: park_holds_key
	DLQTopics        pgtype.FlatArray[*string]    // $22
	RedriveCounts    []int32                      // $23
	Expected         []int64                      // $24, per batch: the stored position the writer left, -1 for none
	Epochs           []int32                      // $25, per batch
	MinID, MinSeq    int64                        // $26, $27: the writer's high-water marks
	Groups           pgtype.FlatArray[*string]    // $28: defer.group, NULL for none
	Gated            []bool                       // $29: defer.gated
	RecordPartitions []int32                      // $30: the partition of the record's batch
}

func (p IngestInsertParams) args() []any {
	return []any{p.Topic, p.Partitions, p.Offsets, p.BusinessKeys, p.Seqs, p.Targets, p.RunAts, p.DelaysMicros,
		p.Attempts, p.States, p.Reasons, p.ErrorClasses, p.ErrorMessages, p.OriginIDs, p.Keys, p.Values,
		p.HeaderRecords, p.HeaderKeys, p.HeaderValues, p.NextOffsets, p.HoldsKey, p.DLQTopics, p.RedriveCounts,
		p.Expected, p.Epochs, p.MinID, p.MinSeq, p.Groups, p.Gated, p.RecordPartitions}
}

// IngestInsertRow is what ingest_insert.sql reports for one batch: its
// partition, whether its position matched (nothing of it was stored
// otherwise), how many rows were stored and how many of those rejected,
// parked and gated, and the highest id and seq stored (nil when none).
type IngestInsertRow struct {
	Partition int32  `db:"partition"`
	Matched   bool   `db:"matched"`
	Stored    int64  `db:"stored"`
	Rejected  int64  `db:"rejected"`
	Parked    int64  `db:"parked"`
	Gated     int64  `db:"gated"`
	MaxID     *int64 `db:"max_id"`
	MaxSeq    *int64 `db:"max_seq"`
}

func (r *IngestInsertRow) dest() []any {
	return []any{&r.Partition, &r.Matched, &r.Stored, &r.Rejected, &r.Parked, &r.Gated, &r.MaxID, &r.MaxSeq}
}

// IngestInsert stores one batch from each of one or more partitions
// (ingest_insert.sql), returning a row per batch in partition order.
func IngestInsert(ctx context.Context, db DBTX, p IngestInsertParams) ([]IngestInsertRow, error) {
	return collect(ctx, db, ingestInsertSQL, p.args(), (*IngestInsertRow).dest)
}

// IngestPositionsParams are ingest_positions.sql's parameters.
type IngestPositionsParams struct {
	Topic      string  // $1
	Partitions []int32 // $2
}

func (p IngestPositionsParams) args() []any { return []any{p.Topic, p.Partitions} }

// IngestPositionsRow is one partition's stored position.
type IngestPositionsRow struct {
	Partition  int32   `db:"partition"`
	NextOffset int64   `db:"next_offset"`
	Epoch      int32   `db:"epoch"`
	TopicID    *string `db:"topic_id"`
}

func (r *IngestPositionsRow) dest() []any {
	return []any{&r.Partition, &r.NextOffset, &r.Epoch, &r.TopicID}
}

// IngestPositions reads stored ingest positions (ingest_positions.sql).
func IngestPositions(ctx context.Context, db DBTX, p IngestPositionsParams) ([]IngestPositionsRow, error) {
	return collect(ctx, db, ingestPositionsSQL, p.args(), (*IngestPositionsRow).dest)
}

// IngestPositionSetParams are ingest_position_set.sql's parameters: move the
// position of Topic/Partition from (FromNext, FromEpoch) to (ToNext,
// ToEpoch), FromNext -1 creating it.
type IngestPositionSetParams struct {
	Topic     string  // $1
	Partition int32   // $2
	FromNext  int64   // $3
	FromEpoch int32   // $4
	ToNext    int64   // $5
	ToEpoch   int32   // $6
	TopicID   *string // $7, nil: none known
}

func (p IngestPositionSetParams) args() []any {
	return []any{p.Topic, p.Partition, p.FromNext, p.FromEpoch, p.ToNext, p.ToEpoch, p.TopicID}
}

// IngestPositionSetRow says whether the position moved.
type IngestPositionSetRow struct {
	Moved bool `db:"moved"`
}

func (r *IngestPositionSetRow) dest() []any { return []any{&r.Moved} }

// IngestPositionSet moves a stored position (ingest_position_set.sql).
func IngestPositionSet(ctx context.Context, db DBTX, p IngestPositionSetParams) (IngestPositionSetRow, error) {
	return one(ctx, db, ingestPositionSetSQL, p.args(), (*IngestPositionSetRow).dest)
}
