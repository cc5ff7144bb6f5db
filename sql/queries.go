// Package sql holds the SQL that ingest and dispatch run, one statement per
// file, embedded into the binary. Keeping statements in .sql files lets
// operators and reviewers read exactly what runs, and lets tests execute each
// file as is.
package sql

import _ "embed"

// Statements the service runs. Each file starts with a comment that documents
// its parameters. They are variables only because go:embed needs one; nothing
// assigns to them.
var (
	//go:embed ingest_insert.sql
	IngestInsert string
	//go:embed ingest_positions.sql
	IngestPositions string
	//go:embed ingest_position_set.sql
	IngestPositionSet string
	//go:embed dispatch_claim.sql
	DispatchClaim string
	//go:embed dispatch_claim_target.sql
	DispatchClaimTarget string
	//go:embed dispatch_lock_messages.sql
	DispatchLockMessages string
	//go:embed dispatch_lock_keys.sql
	DispatchLockKeys string
	//go:embed dispatch_delete.sql
	DispatchDelete string
	//go:embed dispatch_park.sql
	DispatchPark string
	//go:embed dispatch_release.sql
	DispatchRelease string
	//go:embed dispatch_next_due.sql
	DispatchNextDue string
	//go:embed lease_sweep.sql
	LeaseSweep string
	//go:embed dispatch_throttle_sweep.sql
	DispatchThrottleSweep string
	//go:embed dispatch_reap_loops.sql
	DispatchReapLoops string
	//go:embed instance_heartbeat.sql
	InstanceHeartbeat string
	//go:embed instance_leave.sql
	InstanceLeave string
	//go:embed instance_prune.sql
	InstancePrune string
	//go:embed metrics_backlog.sql
	MetricsBacklog string
	//go:embed target_limited.sql
	TargetLimited string
	//go:embed target_peek_tokens.sql
	TargetPeekTokens string
	//go:embed target_take_tokens.sql
	TargetTakeTokens string
	//go:embed target_return_tokens.sql
	TargetReturnTokens string
	//go:embed dlq_claim.sql
	DLQClaim string
	//go:embed dlq_mark_published.sql
	DLQMarkPublished string
	//go:embed dlq_back_off.sql
	DLQBackOff string
	//go:embed queue_analyze.sql
	QueueAnalyze string
	//go:embed history_prune.sql
	HistoryPrune string
)
