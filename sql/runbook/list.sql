-- list.sql: messages matching filters, in due order.
--
-- What: up to :limit messages with the given target topic, state (pending,
-- parked or rejected), business key (exact) and a reason containing the given
-- text (case-insensitive). Every variable must be set; an empty value does not
-- filter. `scheduler ls` runs this file.
-- When: to find the messages of one key, the parked messages of a target, the
-- rejections of one kind.
-- Call:
--   psql "$DATABASE_URL" -v target=payments.retry -v state=parked -v key= \
--        -v reason=unknown_topic -v limit=50 -f sql/runbook/list.sql
SELECT id, business_key, seq, target_topic, state, next_run_at, attempt, reason
FROM deferred_message
WHERE (:'target'::text = '' OR target_topic = :'target')
  AND (:'state'::text = '' OR state = :'state')
  AND (:'key'::text = '' OR business_key = :'key')
  AND (:'reason'::text = '' OR strpos(lower(reason), lower(:'reason')) > 0)
ORDER BY next_run_at, id
LIMIT :limit;
