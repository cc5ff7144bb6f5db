package queries

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
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

// IngestPrepareParams are ingest_prepare.sql's parameters: one element per
// batch in each slice but Topic and the marks.
type IngestPrepareParams struct {
	Topic         string  // $1
	Partitions    []int32 // $2
	NextOffsets   []int64 // $3: the partition's next offset once stored
	Expected      []int64 // $4: the stored position the writer left, -1 for none
	Epochs        []int32 // $5
	Records       []int32 // $6: how many records the batch holds
	FreshSeqs     []int32 // $7: how many of them need a fresh seq
	MinID, MinSeq int64   // $8, $9: the writer's high-water marks
}

func (p IngestPrepareParams) args() []any {
	return []any{p.Topic, p.Partitions, p.NextOffsets, p.Expected, p.Epochs, p.Records, p.FreshSeqs, p.MinID, p.MinSeq}
}

// IngestPrepareRow is what ingest_prepare.sql returns: the transaction's
// now(), the partitions whose position matched (in partition order), and
// the ids and fresh seqs drawn for their records, in the order they are to
// be taken.
type IngestPrepareRow struct {
	Now     time.Time `db:"now"`
	Matched []int32   `db:"matched"`
	IDs     []int64   `db:"ids"`
	Seqs    []int64   `db:"seqs"`
}

func (r *IngestPrepareRow) dest() []any { return []any{&r.Now, &r.Matched, &r.IDs, &r.Seqs} }

// IngestPrepare checks and moves the positions of batches about to be
// copied and draws their ids and seqs (ingest_prepare.sql). Run it in the
// transaction that then calls IngestCopy.
func IngestPrepare(ctx context.Context, db DBTX, p IngestPrepareParams) (IngestPrepareRow, error) {
	return one(ctx, db, ingestPrepareSQL, p.args(), (*IngestPrepareRow).dest)
}

// IngestCopyColumns returns the columns of deferred_message that
// IngestCopy writes, in the order of each row's values; the others take
// their defaults (created_at and updated_at: the transaction's now()).
// internal/defer/ingest's TestStoreCopyMatchesStatement checks that a row
// copied holds what the INSERT statement stores.
func IngestCopyColumns() []string {
	return []string{
		"id", "source_topic", "source_partition", "source_epoch", "source_offset", "business_key", "seq",
		"target_topic", "next_run_at", "attempt", "state", "reason", "error_class", "error_message", "origin_id",
		"key", "value", "header_keys", "header_values", "park_holds_key", "parked_at", "dlq_topic",
		"redrive_count", "group_id", "gated",
	}
}

// Copier copies rows into a table: a pgx.Tx (or a *pgx.Conn, a
// *pgxpool.Pool, though IngestCopy belongs in ingest_prepare.sql's
// transaction).
type Copier interface {
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
}

// IngestCopy writes rows into deferred_message with COPY, each row's values
// in the order of IngestCopyColumns(), and returns how many it wrote. COPY
// has no ON CONFLICT: a row already stored (deferred_message_source_unique)
// fails the whole COPY with a unique violation, and the transaction with
// it. The table's triggers run as for an INSERT.
func IngestCopy(ctx context.Context, db Copier, rows pgx.CopyFromSource) (int64, error) {
	return db.CopyFrom(ctx, pgx.Identifier{"deferred_message"}, IngestCopyColumns(), rows)
}

// IngestFlushChannel is the notification channel ingest_flush.sql sends
// on: a process that listens on it has its ingest write what it holds.
const IngestFlushChannel = "scheduler_ingest_flush"

// IngestFlushParams are ingest_flush.sql's parameters.
type IngestFlushParams struct {
	Channel string // $1: IngestFlushChannel; a parameter so that Go and SQL share it
}

func (p IngestFlushParams) args() []any { return []any{p.Channel} }

// IngestFlush asks every listening process's ingest to write the batches
// it holds now (ingest_flush.sql).
func IngestFlush(ctx context.Context, db DBTX) error {
	_, err := db.Exec(ctx, ingestFlushSQL, IngestFlushParams{Channel: IngestFlushChannel}.args()...)
	return err
}

// IngestStoredParams are ingest_stored.sql's parameters.
type IngestStoredParams struct {
	Topic string // $1
}

func (p IngestStoredParams) args() []any { return []any{p.Topic} }

// IngestStoredRow is how far ingest has stored one partition.
type IngestStoredRow struct {
	Partition  int32 `db:"partition"`
	NextOffset int64 `db:"next_offset"`
}

func (r *IngestStoredRow) dest() []any { return []any{&r.Partition, &r.NextOffset} }

// IngestStored reads how far ingest has stored every partition of a topic
// (ingest_stored.sql).
func IngestStored(ctx context.Context, db DBTX, p IngestStoredParams) ([]IngestStoredRow, error) {
	return collect(ctx, db, ingestStoredSQL, p.args(), (*IngestStoredRow).dest)
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
