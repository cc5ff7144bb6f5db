-- history.sql: everything that happened to a message's lineage.
--
-- What: the events of the lineage of message :id, oldest first (by when
-- they happened), as the view deferred_history has them: deferred_attempt's
-- rows, and the deferrals that are not rows of their own (folded into a
-- 'published' row, or of a message still pending that nothing happened
-- to), read by index through deferred_lineage_history. For each: when,
-- which message (a lineage is a message and every re-deferral of it, each a
-- row of its own), what happened (deferred, or gated: stored pending;
-- parked or rejected: stored or moved there; replayed: moved back to
-- pending; expedited: made due earlier; published: delivered, at partition
-- and record_offset of its target, and deleted; cancelled: deleted by an
-- operator), the attempt, the reason, the error the producer gave, the
-- target and the due time it had then, and who acted (actor:
-- scheduler.actor as the CLI and console set it, e.g. cli:alice, or the
-- psql user; empty for the service's own ingest, publish and park).
-- History outlives the messages: it answers for a message that was
-- delivered and deleted, until HISTORY_RETENTION prunes it. Empty when the
-- message never existed or its history is pruned. `scheduler show` prints
-- it.
-- When: "what happened to order 42's message?": why it was parked, how many
-- times it was retried and replayed, without reading logs.
-- Call:
--   psql "$DATABASE_URL" -v id=1234 -f sql/runbook/history.sql
SELECT h.lineage_id,
       h.message_id,
       h.recorded_at,
       h.event,
       h.attempt,
       h.reason,
       h.error_class,
       h.error_message,
       h.target_topic,
       h.next_run_at,
       h.partition,
       h.record_offset,
       h.actor
FROM deferred_lineage_history(deferred_lineage(:id)) h
ORDER BY h.recorded_at, h.id NULLS LAST, h.event <> 'deferred';
