-- release_inflight.sql: release a consumer group's keys by hand.
--
-- What: deletes the rows of deferred_inflight of consumer group :'group'
-- (exact; required: an empty group releases nothing), only those of
-- business key :'key' if it is not empty, and prints what it released.
-- The keys are no longer blocked for that group (reason in_flight) at
-- once: its consumers go on with them without waiting for a commit past
-- the last record the scheduler republished. If that record was not
-- consumed yet, a later record of the key may be handled before it: do
-- this for a group that will never commit (deleted, renamed, stuck for
-- good), not for one that is merely slow. Run inflight.sql with the same
-- group and key first to see what goes. Like any statement that locks
-- many rows, it can, rarely, deadlock with a finalize of the scheduler
-- (SQLSTATE 40P01): nothing changed, run it again.
-- When: SchedulerInflightStuck fires for a group that is gone, or a
-- consumer group was renamed and the old name holds its keys.
-- Call:
--   psql "$DATABASE_URL" -v group=payment-service -v key= -f sql/runbook/release_inflight.sql
--   psql "$DATABASE_URL" -v group=payment-service -v key=order-42 -f sql/runbook/release_inflight.sql
DELETE FROM deferred_inflight
WHERE group_id = :'group'
  AND (:'key'::text = '' OR business_key = :'key')
RETURNING group_id, business_key, target_topic, partition, record_offset, message_id, seq, published_at,
          date_trunc('second', now() - published_at) AS age,
          extract(epoch FROM now() - published_at)::float8 AS age_seconds;
