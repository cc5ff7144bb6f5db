-- unlimit_target.sql: lift the rate limit of one target topic.
--
-- What: clears the rate limit of :'target' in target_control and prints the
-- row; a target that has no limit prints nothing. Its due messages then go
-- out as fast as dispatch goes; a pause stays as it is.
-- When: the reason for limit_target.sql is over.
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -f sql/runbook/unlimit_target.sql
UPDATE target_control
SET rate_limit = NULL, updated_at = now()
WHERE target_topic = :'target'
  AND rate_limit IS NOT NULL
-- changed_by and changed_at: who made this change (the actor the history
-- records: scheduler.actor, else the psql user), and when.
RETURNING target_topic, paused, rate_limit, weight, note, updated_at,
          coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text) AS changed_by,
          now() AS changed_at;
