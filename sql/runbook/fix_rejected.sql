-- fix_rejected.sql: correct rejected records and send them.
--
-- What: for the rejected messages whose id is in :'ids' (one id or a
-- comma-separated list), sets the target topic to :'target' (empty: keep
-- the one the record named) and the due time to :'due' (a timestamp; empty:
-- now), and moves them to 'pending' with the reason cleared and
-- redrive_count incremented, as replay.sql does for rejected records; then
-- prints them. A record left with no target topic is not touched. An id that
-- is not printed does not exist, is not rejected, or still has no target.
-- The target is not checked against TARGET_TOPICS here: dispatch parks a
-- message to a topic it may not publish to (target_not_allowed), so check
-- it first (the console warns). replay.sql with state=rejected requeues
-- records unchanged.
-- When: a producer sent records without defer.target or with a bad one,
-- and you know where they should go.
-- Call:
--   psql "$DATABASE_URL" -v ids=1234,1235 -v target=payments.retry -v due= -f sql/runbook/fix_rejected.sql
UPDATE deferred_message
SET target_topic = coalesce(nullif(:'target', ''), target_topic),
    next_run_at = coalesce(nullif(:'due', '')::timestamptz, now()),
    state = 'pending',
    reason = NULL,
    redrive_count = redrive_count + 1
WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])
  AND state = 'rejected'
  AND coalesce(nullif(:'target', ''), target_topic, '') <> ''
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason, redrive_count;
