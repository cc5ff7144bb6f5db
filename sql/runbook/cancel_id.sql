-- cancel_id.sql: delete messages for good.
--
-- What: deletes the messages whose id is in :'ids', one id or a
-- comma-separated list, whatever their state, and prints what was deleted. An
-- id that is not printed did not exist (or was just republished and deleted
-- by the scheduler). Deleting a key's head lets the next message of the key
-- go out. There is no undo; the history (history.sql) keeps a 'cancelled'
-- event with the message's last state and who deleted it (scheduler.actor,
-- else the psql user).
-- When: a message must never be delivered (a cancelled order, a poison
-- record), or a rejected record is not worth fixing.
-- Call:
--   psql "$DATABASE_URL" -v ids=1234 -f sql/runbook/cancel_id.sql
--   psql "$DATABASE_URL" -v ids=1234,1235 -f sql/runbook/cancel_id.sql
DELETE FROM deferred_message
WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
