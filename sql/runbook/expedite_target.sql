-- expedite_target.sql: make every waiting message for one target topic due now.
--
-- What: sets next_run_at = now() on the pending messages whose target_topic is
-- :'target' and that are not due yet, and prints them. Per-key order holds:
-- each key still goes out from its head in seq order.
-- The history records each message made due earlier as 'expedited', with
-- who (scheduler.actor, else the psql user).
-- When: a downstream outage is over and its consumers can take the backlog
-- now. Everything becomes due at once, so the target receives the whole
-- backlog as fast as dispatch goes: make sure it can. On a large backlog this
-- locks many rows in one statement; should it end with "deadlock detected"
-- (a dispatcher was finalizing some of them), nothing changed: run it again.
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -f sql/runbook/expedite_target.sql
UPDATE deferred_message
SET next_run_at = now()
WHERE target_topic = :'target'
  AND state = 'pending'
  AND next_run_at > now()
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
