-- list.sql: messages matching filters, in due order.
--
-- What: up to :limit messages whose target topic is LIKE :'target' (% any
-- run, _ one character, \ escapes; an exact name matches itself unless it
-- holds _ or %), in the given state (pending, parked or rejected), of the
-- given business key (exact) and with the given reason code (exact: the part
-- of the reason before the first colon, e.g. unknown_topic, operator). Every
-- variable must be set; an empty value does not filter. `scheduler ls` runs
-- this file, translating its --target glob into a LIKE pattern.
-- When: to find the messages of one key, the parked messages of a target, the
-- rejections of one kind.
-- Call:
--   psql "$DATABASE_URL" -v target='payments.%' -v state=parked -v key= \
--        -v reason=unknown_topic -v limit=50 -f sql/runbook/list.sql
SELECT id, business_key, seq, target_topic, state, next_run_at, attempt, reason
FROM deferred_message
WHERE (:'target'::text = '' OR target_topic LIKE :'target')
  AND (:'state'::text = '' OR state = :'state')
  AND (:'key'::text = '' OR business_key = :'key')
  AND (:'reason'::text = '' OR split_part(reason, ':', 1) = :'reason')
ORDER BY next_run_at, id
LIMIT :limit;
