-- limit_target.sql: cap the rate of republishing to one target topic.
--
-- What: sets the rate limit of :'target' to :'rate' messages per second
-- (a number > 0, fractions allowed) in target_control, and prints the row.
-- Every dispatcher shares one token bucket per target, with at most one
-- second's worth of burst, so the target receives at most about :'rate'
-- messages per second however many replicas run; its messages wait, pending
-- and in per-key order, for their turn. Lowering a limit takes away tokens
-- saved up under the old one. Other targets are not affected. Undo with
-- unlimit_target.sql.
-- When: a target's consumers cannot take the full flow (after an outage, a
-- large replay, a slow downstream).
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -v rate=50 -f sql/runbook/limit_target.sql
INSERT INTO target_control AS c (target_topic, rate_limit)
VALUES (:'target', :'rate'::float8)
ON CONFLICT (target_topic) DO UPDATE
SET rate_limit = excluded.rate_limit,
    tokens = least(c.tokens, excluded.rate_limit),
    updated_at = now()
-- changed_by and changed_at: who made this change (the actor the history
-- records: scheduler.actor, else the psql user), and when.
RETURNING target_topic, paused, rate_limit, weight, note, updated_at,
          coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text) AS changed_by,
          now() AS changed_at;
