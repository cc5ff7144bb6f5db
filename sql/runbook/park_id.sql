-- park_id.sql: set pending messages aside until an operator acts.
--
-- What: moves the pending messages whose id is in :'ids', one id or a
-- comma-separated list, to state 'parked' with reason
-- 'parked by operator: ' followed by :'why', and prints them. A parked message
-- is never sent and releases its key: the next message of the key can go out.
-- An id that is not printed does not exist or is not pending. Undo with
-- replay_parked.sql (a whole target) or an UPDATE setting state = 'pending'.
-- When: a message is known to fail downstream and should stop blocking or
-- retrying, but must be kept for later.
-- Call:
--   psql "$DATABASE_URL" -v ids=1234 -v why='bad address, ticket OPS-7' -f sql/runbook/park_id.sql
UPDATE deferred_message
SET state = 'parked',
    reason = 'parked by operator: ' || :'why'::text
WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])
  AND state = 'pending'
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
