-- expedite_key.sql: make every waiting message of one business key due now.
--
-- What: sets next_run_at = now() on the pending messages of business key :'key'
-- that are not due yet, and prints them. They still go out in seq order, one
-- key head at a time, within a poll interval (usually milliseconds: the head
-- change notifies the dispatchers). A key that backs off after publish
-- failures (held_keys.sql) keeps its back-off.
-- The history records each message made due earlier as 'expedited', with
-- who (scheduler.actor, else the psql user).
-- When: the reason a key was deferred has healed (the provider is back, the
-- data arrived) and waiting out its delays helps no one.
-- Call:
--   psql "$DATABASE_URL" -v key=order-42 -f sql/runbook/expedite_key.sql
UPDATE deferred_message
SET next_run_at = now()
WHERE business_key = :'key'
  AND state = 'pending'
  AND next_run_at > now()
RETURNING id, business_key, seq, target_topic, state, next_run_at, attempt, reason;
