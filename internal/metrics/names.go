// Package metrics defines the scheduler's Prometheus metrics: one prefix,
// labels bounded to target topics, partitions, reasons and kinds (never
// business keys or message ids).
package metrics

// Metric names. Dashboards and alert rules (deploy/) may only use these, the
// Go and process collectors' (go_*, process_*) and promhttp's
// (promhttp_*); a test checks that.
const (
	IngestRecords       = "scheduler_ingest_records_total"          // counter {result: stored|duplicate|rejected}
	IngestRejected      = "scheduler_ingest_rejected_total"         // counter {reason: rejection code}
	IngestParked        = "scheduler_ingest_parked_total"           // counter {reason: code}: parked at ingest by the retry rules
	IngestBatchRecords  = "scheduler_ingest_batch_records"          // histogram
	IngestBatchDuration = "scheduler_ingest_batch_duration_seconds" // histogram
	IngestLag           = "scheduler_ingest_lag_records"            // gauge {partition}: high-water mark minus next offset
	// IngestRollbacks counts the times ingest found a partition's stored
	// position behind where it had been (Postgres went back in time), and
	// IngestReread the records it reads again because of that.
	IngestRollbacks = "scheduler_ingest_rollbacks_total"      // counter
	IngestReread    = "scheduler_ingest_reread_records_total" // counter
	// IngestUnrecoverable counts records the database lost that Kafka no
	// longer has either (the stored position is below the log start).
	IngestUnrecoverable = "scheduler_ingest_unrecoverable_records_total" // counter
	// IngestPartitionResets counts partitions found re-created or truncated
	// (high-water mark below the stored position, or a new topic id).
	IngestPartitionResets = "scheduler_ingest_partition_resets_total" // counter
	IngestBufferedBytes   = "scheduler_ingest_buffered_bytes"         // gauge: record bytes ingest holds (INGEST_BUFFER_BYTES bounds it)
	DispatchPublished     = "scheduler_dispatch_published_total"      // counter {target}
	DispatchPublishErrors = "scheduler_dispatch_publish_errors_total" // counter {target, kind}
	DispatchParked        = "scheduler_dispatch_parked_total"         // counter {target, reason: code}
	DispatchLateness      = "scheduler_dispatch_lateness_seconds"     // histogram: broker ack time minus due time
	DispatchRoundDuration = "scheduler_dispatch_round_duration_seconds"
	DispatchClaimWait     = "scheduler_dispatch_claim_wait_seconds"
	DispatchExpressKeys   = "scheduler_dispatch_express_keys_total" // counter: keys of light targets claimed by express rounds
	Messages              = "scheduler_messages"                    // gauge {target, state}
	MessagesDue           = "scheduler_messages_due"                // gauge {target}: pending and due, not yet sent
	OldestDue             = "scheduler_oldest_due_seconds"          // gauge: how late the earliest due head is now
	// HeldKeys counts keys backing off after retriable publish failures (a
	// broker or topic problem); they retry by themselves. Not to be confused
	// with KeysHeldParked.
	HeldKeys = "scheduler_held_keys" // gauge
	// KeysHeldParked counts keys held by a parked message (its retry policy
	// holds the key): nothing more of the key goes out until an operator
	// replays or deletes that message.
	KeysHeldParked      = "scheduler_keys_held_parked"         // gauge
	DLQPublished        = "scheduler_dlq_published_total"      // counter: dead-letter copies acknowledged
	DLQPublishErrors    = "scheduler_dlq_publish_errors_total" // counter {kind}: failed copies, retried later
	DLQUnsent           = "scheduler_dlq_unsent"               // gauge: parked messages whose dead-letter copy is not yet acknowledged
	DBPoolConnections   = "scheduler_db_pool_connections"      // gauge {state: acquired|idle|total|max}
	DBPoolAcquireWait   = "scheduler_db_pool_acquire_wait_seconds_total"
	DBOldestTransaction = "scheduler_db_oldest_transaction_seconds" // gauge: oldest open transaction holding back vacuum
	RiverJobs           = "scheduler_river_jobs_total"              // counter {kind, outcome}
	Ready               = "scheduler_ready"                         // gauge: 1 when /readyz passes
	BuildInfo           = "scheduler_build_info"                    // gauge {version} = 1

	// Key order end to end (docs/design.md section 23).
	IngestGated      = "scheduler_ingest_gated_total"            // counter: records stored pending behind a blocked key (defer.gated)
	IngestMisrouted  = "scheduler_ingest_misrouted_total"        // counter: records read from a partition other than their business key's
	KeyStateRequests = "scheduler_key_state_requests_total"      // counter {result: answered|unsure|refused}
	KeyStateDuration = "scheduler_key_state_duration_seconds"    // histogram: answered requests, the wait for ingest included
	KeyStateKeys     = "scheduler_key_state_keys_total"          // counter {answer: blocked|free}
	KeySetRequests   = "scheduler_key_set_requests_total"        // counter {query: set|changes, result: answered|reset|unsure|refused}
	InflightKeys     = "scheduler_inflight_keys"                 // gauge: keys republished and not yet committed past by their group
	InflightOldest   = "scheduler_inflight_oldest_seconds"       // gauge: age of the oldest of those
	InflightReleased = "scheduler_inflight_released_total"       // counter: keys released by their group's commit
	InflightErrors   = "scheduler_inflight_release_errors_total" // counter: failed reads of a group's committed offsets
)

// Names returns every metric name the scheduler exports.
func Names() []string {
	return []string{
		IngestRecords, IngestRejected, IngestParked, IngestBatchRecords, IngestBatchDuration, IngestLag,
		IngestRollbacks, IngestReread, IngestUnrecoverable, IngestPartitionResets, IngestBufferedBytes,
		DispatchPublished, DispatchPublishErrors, DispatchParked, DispatchLateness, DispatchRoundDuration, DispatchClaimWait,
		DispatchExpressKeys,
		Messages, MessagesDue, OldestDue, HeldKeys, KeysHeldParked, DLQPublished, DLQPublishErrors, DLQUnsent,
		DBPoolConnections, DBPoolAcquireWait, DBOldestTransaction,
		RiverJobs, Ready, BuildInfo,
		IngestGated, IngestMisrouted, KeyStateRequests, KeyStateDuration, KeyStateKeys, KeySetRequests,
		InflightKeys, InflightOldest, InflightReleased, InflightErrors,
	}
}
