-- targets.sql: the per-target controls.
--
-- What: the rows of target_control with something set (paused, a rate limit,
-- a weight other than 1, or a note): whether the target topic is paused
-- (pause_target.sql) and why (note), its rate limit in messages per second
-- (limit_target.sql; empty: none), its weight in the claims' turns
-- (weight_target.sql), when it last changed, and who made the last change
-- of its pause, limit, weight or note and when (changed_by, changed_at, from
-- target_control_history; changed_by is scheduler.actor, e.g. cli:alice, or
-- the psql user). A target not listed flows freely.
-- When: to see what an operator has put in place, e.g. before resuming after
-- an incident. `scheduler targets` runs this file.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/targets.sql
SELECT c.target_topic, c.paused, c.rate_limit, c.weight, c.note, c.updated_at, h.actor AS changed_by, h.changed_at
FROM target_control c
LEFT JOIN LATERAL (
    SELECT actor, changed_at FROM target_control_history
    WHERE target_topic = c.target_topic
    ORDER BY id DESC
    LIMIT 1
) h ON true
WHERE c.paused OR c.rate_limit IS NOT NULL OR c.weight <> 1 OR c.note IS NOT NULL
ORDER BY c.target_topic;
