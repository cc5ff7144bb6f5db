-- backlog.sql: the backlog by target topic and state.
--
-- What: one row per (target_topic, state) with the number of messages, how
-- many pending ones are already due, and the earliest and latest next_run_at
-- of the pending ones. target_topic is empty for a record rejected before it
-- named one.
-- When: first look at a growing backlog, or to see where parked and rejected
-- messages pile up. It reads the whole table: seconds on many millions of
-- rows, harmless otherwise. `scheduler status` shows it.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/backlog.sql
SELECT target_topic,
       state,
       count(*) AS messages,
       count(*) FILTER (WHERE state = 'pending' AND next_run_at <= now()) AS due,
       min(next_run_at) FILTER (WHERE state = 'pending') AS first_run_at,
       max(next_run_at) FILTER (WHERE state = 'pending') AS last_run_at
FROM deferred_message
GROUP BY target_topic, state
ORDER BY target_topic NULLS FIRST, state;
