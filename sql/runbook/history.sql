-- history.sql: everything that happened to a message's lineage.
--
-- What: the deferred_attempt rows of the lineage of message :id, oldest
-- first: when, which message (a lineage is a message and every re-deferral of
-- it, each a row of its own), what happened (deferred, or gated: stored
-- pending; parked or rejected: stored or moved there; replayed: moved back to
-- pending; expedited: made due earlier; published: delivered, at partition
-- and record_offset of its target, and deleted; cancelled: deleted by an
-- operator), the attempt, the reason, the error the producer gave, the
-- target and the due time it had then, and who acted (actor: scheduler.actor
-- as the CLI and console set it, e.g. cli:alice, or the psql user; empty for
-- the service's own ingest, publish and park). History outlives the messages: it answers for
-- a message that was delivered and deleted, until HISTORY_RETENTION prunes it.
-- Empty when the message never existed or its history is pruned.
-- `scheduler show` prints it.
-- When: "what happened to order 42's message?": why it was parked, how many
-- times it was retried and replayed, without reading logs.
-- Call:
--   psql "$DATABASE_URL" -v id=1234 -f sql/runbook/history.sql
SELECT a.lineage_id,
       a.message_id,
       a.recorded_at,
       a.event,
       a.attempt,
       a.reason,
       a.error_class,
       a.error_message,
       a.target_topic,
       a.next_run_at,
       a.partition,
       a.record_offset,
       a.actor
FROM deferred_attempt a
WHERE a.lineage_id = (SELECT lineage_id FROM deferred_attempt WHERE message_id = :id ORDER BY id LIMIT 1)
ORDER BY a.id;
