-- resume_target.sql: republish to a paused target topic again.
--
-- What: clears the pause of :'target' in target_control and prints the row;
-- a target that is not paused prints nothing. Its due messages go out in
-- per-key order at once (dispatchers are notified), paced by its rate limit
-- if it has one; the rest when due. The note stays, for the record.
-- When: the reason for pause_target.sql is over. See what will go out first:
--   psql "$DATABASE_URL" -v target=payments.retry -v state=pending -v key= \
--        -v reason= -v limit=100 -f sql/runbook/list.sql
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -f sql/runbook/resume_target.sql
UPDATE target_control
SET paused = false, updated_at = now()
WHERE target_topic = :'target'
  AND paused
-- changed_by and changed_at: who made this change (the actor the history
-- records: scheduler.actor, else the psql user), and when.
RETURNING target_topic, paused, rate_limit, weight, note, updated_at,
          coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text) AS changed_by,
          now() AS changed_at;
