-- targets.sql: the per-target controls.
--
-- What: every row of target_control: whether the target topic is paused
-- (pause_target.sql) and why (note), its rate limit in messages per second
-- (limit_target.sql; empty: none), and when it last changed. A target
-- without a row flows freely.
-- When: to see what an operator has put in place, e.g. before resuming after
-- an incident. `scheduler targets` runs this file.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/targets.sql
SELECT target_topic, paused, rate_limit, note, updated_at
FROM target_control
ORDER BY target_topic;
