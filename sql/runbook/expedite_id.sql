-- expedite_id.sql: make given pending messages due now.
--
-- What: sets next_run_at to now() (or leaves it, if earlier) on the pending
-- messages whose id is in :'ids', one id or a comma-separated list, and prints
-- them. An id that is not printed does not exist or is not pending (parked and
-- rejected messages are never sent: see replay_parked.sql). A message goes out
-- only once it is the head of its key: expediting one behind a waiting head
-- makes it due but not first (expedite_key.sql moves the whole key).
-- The history records each message made due earlier as 'expedited', with
-- who (scheduler.actor, else the psql user).
-- When: one message should go out now rather than at its time.
-- Call:
--   psql "$DATABASE_URL" -v ids=1234 -f sql/runbook/expedite_id.sql
--   psql "$DATABASE_URL" -v ids=1234,1235 -f sql/runbook/expedite_id.sql
UPDATE deferred_message
SET next_run_at = least(next_run_at, now())
WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])
  AND state = 'pending'
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
