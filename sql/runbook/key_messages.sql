-- key_messages.sql: every message of one business key, in the order it goes.
--
-- What: up to :limit messages of business key :'key' (exact), in seq order
-- (the order they are republished in), after seq :'after_seq' and id
-- :'after_id' (the last row of the previous page; empty: from the start),
-- whatever their state, each marked when it is the key's head (the next to
-- go, or the parked message holding the key: holds_key). Each state is read
-- through the index that covers it (deferred_message_key_order,
-- deferred_message_rejected_key, and deferred_message_released_key for
-- parked messages that released their key).
-- When: "what waits behind this one?", or everything of one order, account
-- or device.
-- Call:
--   psql "$DATABASE_URL" -v key=order-42 -v after_seq= -v after_id= -v limit=50 -f sql/runbook/key_messages.sql
SELECT m.id,
       m.business_key,
       m.seq,
       m.target_topic,
       m.state,
       m.next_run_at,
       m.attempt,
       m.reason,
       m.error_class,
       m.created_at,
       m.redrive_count,
       k.head_id IS NOT NULL AS is_head,
       coalesce(k.held, false) AS holds_key
FROM (
    SELECT * FROM deferred_message
    WHERE business_key = :'key' AND (state = 'pending' OR (state = 'parked' AND park_holds_key))
    UNION ALL
    SELECT * FROM deferred_message
    WHERE business_key = :'key' AND state = 'rejected'
    UNION ALL
    SELECT * FROM deferred_message
    WHERE business_key = :'key' AND state = 'parked' AND NOT park_holds_key
) m
LEFT JOIN deferred_key k ON k.head_id = m.id
WHERE :'after_seq'::text = ''
   OR (m.seq, m.id) > (nullif(:'after_seq', '')::bigint, coalesce(nullif(:'after_id', '')::bigint, 0))
ORDER BY m.seq, m.id
LIMIT :limit;
