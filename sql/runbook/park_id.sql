-- park_id.sql: set pending messages aside until an operator acts.
--
-- What: moves the pending messages whose id is in :'ids', one id or a
-- comma-separated list, to state 'parked' with the reason 'operator: '
-- followed by :'why' (reason code operator), and prints them. A parked
-- message is never sent. Whether it holds its business key follows its retry policy
-- (park_holds_key, set at ingest; the default holds): the later messages of
-- the key wait behind it until it is replayed or cancelled. :'release' true
-- makes it release the key instead, so that the rest of the key goes on
-- without it. An id that is not printed does not exist or is not pending.
-- Undo with replay.sql.
-- The history records the park with who (scheduler.actor, else the psql
-- user).
-- When: a message is known to fail downstream and should stop retrying, but
-- must be kept for later; with release=true, also when it must stop blocking
-- its key.
-- Call:
--   psql "$DATABASE_URL" -v ids=1234 -v why='bad address, ticket OPS-7' -v release=false -f sql/runbook/park_id.sql
UPDATE deferred_message
SET state = 'parked',
    reason = 'operator: ' || :'why'::text,
    park_holds_key = park_holds_key AND NOT :'release'::boolean
WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])
  AND state = 'pending'
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
