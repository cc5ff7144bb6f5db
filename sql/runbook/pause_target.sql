-- pause_target.sql: stop republishing to one target topic.
--
-- What: marks :'target' paused in target_control, with a note saying why
-- (empty: none; pausing a paused target again with an empty note keeps its
-- note), and prints the row. Its messages stay pending, in order, and
-- keep arriving; messages to every other target flow as before. Dispatchers
-- see it at their next poll (within POLL_INTERVAL); a message already being
-- published finishes. A rate limit (limit_target.sql) stays as it is.
-- When: the consumers of the target are down or must not get retries now
-- (an incident, a deploy, a data fix). Undo with resume_target.sql.
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -v note='provider incident INC-42' -f sql/runbook/pause_target.sql
INSERT INTO target_control AS c (target_topic, paused, note)
VALUES (:'target', true, nullif(:'note', ''))
ON CONFLICT (target_topic) DO UPDATE
-- Pausing again without a note keeps the note that says why.
SET paused = true, note = coalesce(excluded.note, c.note), updated_at = now()
-- changed_by and changed_at: who made this change (the actor the history
-- records: scheduler.actor, else the psql user), and when.
RETURNING target_topic, paused, rate_limit, weight, note, updated_at,
          coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text) AS changed_by,
          now() AS changed_at;
