-- replay_parked.sql: send a target's parked messages again, now.
--
-- What: moves every parked message whose target_topic is :'target' back to
-- 'pending', due now, with its reason cleared and its redrive_count
-- incremented, and prints them. Each goes back to its place in its key (its
-- seq): if later messages of the key are pending, it goes out before them;
-- any that already went out stay out. A parked message that held its key
-- goes first and the rest of the key follows. replay.sql does the same with
-- finer filters (reason code, key, error class, time, ids) and at a rate.
-- When: the cause of the parking is fixed (the topic now exists, the ACL was
-- granted, the record size limit raised). Check first what would move:
--   psql "$DATABASE_URL" -v target=payments.retry -v state=parked -v key= \
--        -v reason= -v limit=1000 -f sql/runbook/list.sql
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -f sql/runbook/replay_parked.sql
UPDATE deferred_message
SET state = 'pending',
    next_run_at = now(),
    reason = NULL,
    redrive_count = redrive_count + 1
WHERE state = 'parked'
  AND target_topic = :'target'
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
