package queries

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// DLQClaimParams are dlq_claim.sql's parameters.
type DLQClaimParams struct {
	Limit    int           // $1: copies to lease at most
	Lease    time.Duration // $2
	MaxBytes int64         // $3: the round's byte budget, at least 1
}

func (p DLQClaimParams) args() []any { return []any{p.Limit, p.Lease, p.MaxBytes} }

// DLQClaimRow is one leased dead-letter copy: the record and the failure
// context it carries.
type DLQClaimRow struct {
	ID              int64      `db:"id"`
	Seq             int64      `db:"seq"`
	Target          *string    `db:"target_topic"`
	Attempt         int32      `db:"attempt"`
	RedriveCount    int32      `db:"redrive_count"`
	DLQTopic        string     `db:"dlq_topic"`
	Reason          *string    `db:"reason"`
	ErrorClass      *string    `db:"error_class"`
	ErrorMessage    *string    `db:"error_message"`
	ParkedAt        *time.Time `db:"parked_at"`
	SourceTopic     *string    `db:"source_topic"`
	SourcePartition *int32     `db:"source_partition"`
	SourceOffset    *int64     `db:"source_offset"`
	Key             []byte     `db:"key"`
	Value           []byte     `db:"value"`
	HeaderKeys      []string   `db:"header_keys"`
	HeaderValues    [][]byte   `db:"header_values"`
}

func (r *DLQClaimRow) dest() []any {
	return []any{&r.ID, &r.Seq, &r.Target, &r.Attempt, &r.RedriveCount, &r.DLQTopic, &r.Reason, &r.ErrorClass,
		&r.ErrorMessage, &r.ParkedAt, &r.SourceTopic, &r.SourcePartition, &r.SourceOffset, &r.Key, &r.Value,
		&r.HeaderKeys, &r.HeaderValues}
}

// DLQClaim leases dead-letter copies to publish (dlq_claim.sql).
func DLQClaim(ctx context.Context, db DBTX, p DLQClaimParams) ([]DLQClaimRow, error) {
	return collect(ctx, db, dlqClaimSQL, p.args(), (*DLQClaimRow).dest)
}

// DLQMarkPublishedParams are dlq_mark_published.sql's parameters.
type DLQMarkPublishedParams struct {
	IDs      []int64     // $1
	ParkedAt []time.Time // $2: the parked_at each claim read
}

func (p DLQMarkPublishedParams) args() []any { return []any{p.IDs, p.ParkedAt} }

// DLQMarkPublishedRow is a copy marked published.
type DLQMarkPublishedRow struct {
	ID int64 `db:"id"`
}

func (r *DLQMarkPublishedRow) dest() []any { return []any{&r.ID} }

// QueueDLQMarkPublished adds dlq_mark_published.sql to b; when the batch
// runs, marked receives the ids it marked.
func QueueDLQMarkPublished(b *pgx.Batch, p DLQMarkPublishedParams, marked *[]int64) {
	b.Queue(dlqMarkPublishedSQL, p.args()...).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var r DLQMarkPublishedRow
			if err := rows.Scan(r.dest()...); err != nil {
				return err
			}
			*marked = append(*marked, r.ID)
		}
		return rows.Err()
	})
}

// DLQBackOffParams are dlq_back_off.sql's parameters.
type DLQBackOffParams struct {
	IDs      []int64         // $1
	ParkedAt []time.Time     // $2
	BackOffs []time.Duration // $3, one per copy
}

func (p DLQBackOffParams) args() []any { return []any{p.IDs, p.ParkedAt, p.BackOffs} }

// QueueDLQBackOff adds dlq_back_off.sql to b.
func QueueDLQBackOff(b *pgx.Batch, p DLQBackOffParams) { b.Queue(dlqBackOffSQL, p.args()...) }
