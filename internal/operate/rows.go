package operate

import (
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// The kinds of held key in held_keys.sql.
const (
	HeldParked     = "parked"
	HeldBackingOff = "backing_off"
	HeldLeased     = "leased"
	HeldInFlight   = "in_flight"
)

// Message is one message as list.sql and every changing runbook file
// return it.
type Message struct {
	ID          int64     `db:"id" json:"id"`
	BusinessKey *string   `db:"business_key" json:"business_key"`
	Seq         int64     `db:"seq" json:"seq"`
	TargetTopic *string   `db:"target_topic" json:"target_topic"`
	State       string    `db:"state" json:"state"`
	NextRunAt   time.Time `db:"next_run_at" json:"next_run_at"`
	Attempt     int32     `db:"attempt" json:"attempt"`
	Reason      *string   `db:"reason" json:"reason"`
}

// BacklogRow is a row of backlog.sql.
type BacklogRow struct {
	TargetTopic *string    `db:"target_topic" json:"target_topic"`
	State       string     `db:"state" json:"state"`
	Messages    int64      `db:"messages" json:"messages"`
	Due         int64      `db:"due" json:"due"`
	FirstRunAt  *time.Time `db:"first_run_at" json:"first_run_at"`
	LastRunAt   *time.Time `db:"last_run_at" json:"last_run_at"`
}

// OldestDueRow is the row of oldest_due.sql.
type OldestDueRow struct {
	DueHeads        int64           `db:"due_heads" json:"-"`
	ID              *int64          `db:"id" json:"id"`
	BusinessKey     *string         `db:"business_key" json:"business_key"`
	TargetTopic     *string         `db:"target_topic" json:"target_topic"`
	DueAt           *time.Time      `db:"due_at" json:"due_at"`
	Lateness        pgtype.Interval `db:"lateness" json:"-"` // for psql; lateness_seconds is exact
	LatenessSeconds float64         `db:"lateness_seconds" json:"lateness_seconds"`
	// Why due messages wait: see oldest_due.sql.
	DueMessages        int64 `db:"due_messages" json:"due_messages"`
	WaitingPaused      int64 `db:"waiting_paused" json:"waiting_paused"`
	WaitingParked      int64 `db:"waiting_parked" json:"waiting_parked"`
	WaitingInFlight    int64 `db:"waiting_in_flight" json:"waiting_in_flight"`
	WaitingBehind      int64 `db:"waiting_behind" json:"waiting_behind"`
	WaitingRateLimited int64 `db:"waiting_rate_limited" json:"waiting_rate_limited"`
	WaitingBackingOff  int64 `db:"waiting_backing_off" json:"waiting_backing_off"`
	WaitingLeased      int64 `db:"waiting_leased" json:"waiting_leased"`
}

// HeldKeyRow is a row of held_keys.sql.
type HeldKeyRow struct {
	BusinessKey *string    `db:"business_key" json:"business_key"`
	Kind        string     `db:"kind" json:"kind"` // parked, backing_off, in_flight or leased
	Why         string     `db:"why" json:"why"`
	Failures    int32      `db:"failures" json:"failures"`
	LeasedUntil *time.Time `db:"leased_until" json:"leased_until"`
	LeasedBy    *string    `db:"leased_by" json:"leased_by"`
	HeadID      int64      `db:"head_id" json:"head_id"`
	HeadSeq     *int64     `db:"head_seq" json:"head_seq"`
	TargetTopic *string    `db:"target_topic" json:"target_topic"`
	// NextRunAt is null for a parked head: it never comes due.
	NextRunAt  *time.Time `db:"next_run_at" json:"next_run_at"`
	Attempt    *int32     `db:"attempt" json:"attempt"`
	ErrorClass *string    `db:"error_class" json:"error_class"`
	Reason     *string    `db:"reason" json:"reason"`       // the parked head's
	ParkedAt   *time.Time `db:"parked_at" json:"parked_at"` // the parked head's
	Waiting    int64      `db:"waiting" json:"waiting"`     // pending messages of the key behind the head
	// HeldTotal is how many keys are held in all, whatever the limit.
	HeldTotal int64 `db:"held_total" json:"-"`
}

// RejectedRow is a row of rejected_recent.sql.
type RejectedRow struct {
	Reason   string    `db:"reason" json:"reason"`
	Messages int64     `db:"messages" json:"messages"`
	Latest   time.Time `db:"latest" json:"latest"`
}

// MessageRow is the first result of show_message.sql.
type MessageRow struct {
	Message
	ErrorClass      *string    `db:"error_class" json:"error_class"`
	ErrorMessage    *string    `db:"error_message" json:"error_message"`
	OriginID        *int64     `db:"origin_id" json:"origin_id"`
	CreatedAt       time.Time  `db:"created_at" json:"created_at"`
	UpdatedAt       time.Time  `db:"updated_at" json:"updated_at"`
	SourceTopic     *string    `db:"source_topic" json:"source_topic"`
	SourcePartition *int32     `db:"source_partition" json:"source_partition"`
	SourceOffset    *int64     `db:"source_offset" json:"source_offset"`
	ParkedAt        *time.Time `db:"parked_at" json:"parked_at"`
	ParkHoldsKey    bool       `db:"park_holds_key" json:"park_holds_key"`
	DLQTopic        *string    `db:"dlq_topic" json:"dlq_topic"`
	DLQPublishedAt  *time.Time `db:"dlq_published_at" json:"dlq_published_at"`
	RedriveCount    int32      `db:"redrive_count" json:"redrive_count"`
	HoldsKey        bool       `db:"holds_key" json:"holds_key"` // a parked head holding its key
	WaitingBehind   *int64     `db:"waiting_behind" json:"waiting_behind"`
	IsHead          bool       `db:"is_head" json:"is_head"`
	PendingAhead    *int64     `db:"pending_ahead" json:"pending_ahead"`
	KeyEncoding     *string    `db:"key_encoding" json:"key_encoding"` // text, hex, or null: no key
	Key             *string    `db:"key" json:"key"`
	KeyTruncated    bool       `db:"-" json:"key_truncated"`
	ValueBytes      *int32     `db:"value_bytes" json:"value_bytes"`
	ValueEncoding   *string    `db:"value_encoding" json:"value_encoding"`
	Value           *string    `db:"value" json:"value"`
	ValueTruncated  bool       `db:"-" json:"value_truncated"`
}

// HeaderRow is a row of the second result of show_message.sql.
type HeaderRow struct {
	Position  int64   `db:"position" json:"position"`
	Key       *string `db:"key" json:"key"`
	Encoding  *string `db:"encoding" json:"encoding"`
	Value     *string `db:"value" json:"value"`
	Truncated bool    `db:"-" json:"truncated"`
}

// LineageRow is a row of the third result of show_message.sql.
type LineageRow struct {
	Relation string `db:"relation" json:"relation"`
	Message
}

// HistoryRow is a row of history.sql and of the fourth result of
// show_message.sql.
type HistoryRow struct {
	LineageID    int64      `db:"lineage_id" json:"lineage_id"`
	MessageID    int64      `db:"message_id" json:"message_id"`
	RecordedAt   time.Time  `db:"recorded_at" json:"recorded_at"`
	Event        string     `db:"event" json:"event"` // deferred, gated, parked, rejected, replayed, expedited, published or cancelled
	Attempt      int32      `db:"attempt" json:"attempt"`
	Reason       *string    `db:"reason" json:"reason"`
	ErrorClass   *string    `db:"error_class" json:"error_class"`
	ErrorMessage *string    `db:"error_message" json:"error_message"`
	TargetTopic  *string    `db:"target_topic" json:"target_topic"`
	NextRunAt    *time.Time `db:"next_run_at" json:"next_run_at"`
	// Partition and RecordOffset: where a published message went.
	Partition    *int32 `db:"partition" json:"partition"`
	RecordOffset *int64 `db:"record_offset" json:"record_offset"`
	// Actor is who made the change: scheduler.actor (operate.SetActor, e.g.
	// cli:alice), else the database user; null for the service's own
	// events (ingest, publish, dispatch's parks).
	Actor *string `db:"actor" json:"actor"`
}

// InflightRow is a row of inflight.sql and release_inflight.sql.
type InflightRow struct {
	GroupID      string          `db:"group_id" json:"group_id"`
	BusinessKey  string          `db:"business_key" json:"business_key"`
	TargetTopic  string          `db:"target_topic" json:"target_topic"`
	Partition    int32           `db:"partition" json:"partition"`
	RecordOffset int64           `db:"record_offset" json:"record_offset"`
	MessageID    int64           `db:"message_id" json:"message_id"`
	Seq          int64           `db:"seq" json:"seq"`
	PublishedAt  time.Time       `db:"published_at" json:"published_at"`
	Age          pgtype.Interval `db:"age" json:"-"` // for psql; age_seconds is exact
	AgeSeconds   float64         `db:"age_seconds" json:"age_seconds"`
}

// ReplayCandidate is a row of replay_preview.sql.
type ReplayCandidate struct {
	ID           int64     `db:"id" json:"id"`
	BusinessKey  *string   `db:"business_key" json:"business_key"`
	Seq          int64     `db:"seq" json:"seq"`
	TargetTopic  *string   `db:"target_topic" json:"target_topic"`
	State        string    `db:"state" json:"state"`
	Reason       *string   `db:"reason" json:"reason"`
	ErrorClass   *string   `db:"error_class" json:"error_class"`
	Attempt      int32     `db:"attempt" json:"attempt"`
	RedriveCount int32     `db:"redrive_count" json:"redrive_count"`
	Since        time.Time `db:"since" json:"since"` // parked_at; for a rejected message, updated_at
	HoldsKey     bool      `db:"holds_key" json:"holds_key"`
	Replayable   bool      `db:"replayable" json:"replayable"`
}

// ReplayedMessage is a row of replay.sql.
type ReplayedMessage struct {
	Message
	RedriveCount int32 `db:"redrive_count" json:"redrive_count"`
}

// MaxTargetWeight is the largest target_control.weight (its CHECK
// constraint, migration 0019).
const MaxTargetWeight = 100

// TargetRow is a row of target_control as every target runbook file prints
// it.
type TargetRow struct {
	TargetTopic string   `db:"target_topic" json:"target_topic"`
	Paused      bool     `db:"paused" json:"paused"`
	RateLimit   *float64 `db:"rate_limit" json:"rate_limit"` // messages per second; null: none
	// Weight is how many of the target's heads each turn of a claim takes
	// while other targets have due heads too; 1 by default, at most
	// MaxTargetWeight.
	Weight    int       `db:"weight" json:"weight"`
	Note      *string   `db:"note" json:"note"`
	UpdatedAt time.Time `db:"updated_at" json:"updated_at"`
	// ChangedBy and ChangedAt say who last changed the pause, limit,
	// weight or note and when (target_control_history; for a changing
	// file, this change): scheduler.actor (operate.SetActor), else the
	// database user. Null for a row last changed before the history was
	// kept.
	ChangedBy *string    `db:"changed_by" json:"changed_by"`
	ChangedAt *time.Time `db:"changed_at" json:"changed_at"`
}
