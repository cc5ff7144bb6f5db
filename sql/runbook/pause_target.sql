-- pause_target.sql: stop republishing to one target topic.
--
-- What: marks :'target' paused in target_control, with a note saying why
-- (empty: none), and prints the row. Its messages stay pending, in order, and
-- keep arriving; messages to every other target flow as before. Dispatchers
-- see it at their next poll (within POLL_INTERVAL); a message already being
-- published finishes. A rate limit (limit_target.sql) stays as it is.
-- When: the consumers of the target are down or must not get retries now
-- (an incident, a deploy, a data fix). Undo with resume_target.sql.
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -v note='provider incident INC-42' -f sql/runbook/pause_target.sql
INSERT INTO target_control (target_topic, paused, note)
VALUES (:'target', true, nullif(:'note', ''))
ON CONFLICT (target_topic) DO UPDATE
SET paused = true, note = excluded.note, updated_at = now()
RETURNING target_topic, paused, rate_limit, note, updated_at;
