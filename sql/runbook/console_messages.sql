-- console_messages.sql: one page of messages matching filters.
--
-- What: up to :limit messages matching every filter given (empty: any):
--   state        pending, parked or rejected
--   target       target_topic LIKE this pattern (% any run, _ one character)
--   reason       reason code, exact: the part of the reason before the first
--                colon (unknown_topic, exhausted, ...)
--   error_class  error_class LIKE this pattern
--   since/until  stored (created_at) at or after since, before until
-- in the order :'sort' names: due (next_run_at, then id), oldest (id) or
-- newest (id, descending), starting after the cursor :'after_at' /
-- :'after_id' (the last row of the previous page: its next_run_at for due,
-- and its id; empty: from the start). No count: a page reads only as far as
-- it needs, so the next page is always as fast as the first. Sorted by id
-- it walks the primary key. Sorted by due time, pending messages are listed
-- the way dispatch takes them: the head of each key (the message that goes
-- next) in the order of its key's due time (deferred_key.next_run_at, which
-- includes a back-off after failed publishes), read from deferred_key's
-- due-time indexes; the messages waiting behind a head are not listed
-- (key_messages.sql lists them), and next_run_at is the key's. A table of
-- millions of pending rows has no index on their own due time, and sorting
-- them all took a second per page. Parked and rejected rows sorted by due
-- time are read through deferred_message_not_pending and sorted. Each row
-- says whether the message is the head of its key.
-- The messages of one business key are key_messages.sql's (the console
-- filters those): no index holds every row's key.
-- When: to find messages: the parked ones of a target, the rejections of
-- one kind, what was stored in the last hour.
-- Call:
--   psql "$DATABASE_URL" -v state=parked -v target='payments.%' -v reason=unknown_topic \
--        -v error_class= -v since= -v until= -v sort=oldest -v after_at= -v after_id= -v limit=50 \
--        -f sql/runbook/console_messages.sql
SELECT p.*,
       EXISTS (SELECT 1 FROM deferred_key k WHERE k.head_id = p.id) AS is_head
FROM (
    -- Due order of pending messages: the key heads, as dispatch takes them.
    (SELECT m.id, m.business_key, m.seq, m.target_topic, m.state, k.next_run_at, m.attempt, m.reason,
            m.error_class, m.created_at, m.redrive_count
     FROM deferred_key k
     JOIN deferred_message m ON m.id = k.head_id
     WHERE :'sort' = 'due' AND :'state' IN ('', 'pending')
       AND NOT k.throttled
       -- deferred_key_due's bound (migration 0009): pending heads are never
       -- 'infinity'.
       AND k.next_run_at < 'infinity'
       AND m.state = 'pending'
       AND (:'target'::text = '' OR m.target_topic LIKE :'target')
       AND (:'reason'::text = '' OR split_part(m.reason, ':', 1) = :'reason')
       AND (:'error_class'::text = '' OR m.error_class LIKE :'error_class')
       AND (:'since'::text = '' OR m.created_at >= nullif(:'since', '')::timestamptz)
       AND (:'until'::text = '' OR m.created_at < nullif(:'until', '')::timestamptz)
       AND (:'after_id'::text = ''
            OR (k.next_run_at, k.head_id) > (nullif(:'after_at', '')::timestamptz, nullif(:'after_id', '')::bigint))
     ORDER BY k.next_run_at, k.head_id
     LIMIT :limit)
    UNION ALL
    -- The heads of rate-limited targets live in the other partial index.
    (SELECT m.id, m.business_key, m.seq, m.target_topic, m.state, k.next_run_at, m.attempt, m.reason,
            m.error_class, m.created_at, m.redrive_count
     FROM deferred_key k
     JOIN deferred_message m ON m.id = k.head_id
     WHERE :'sort' = 'due' AND :'state' IN ('', 'pending')
       AND k.throttled
       AND m.state = 'pending'
       AND (:'target'::text = '' OR m.target_topic LIKE :'target')
       AND (:'reason'::text = '' OR split_part(m.reason, ':', 1) = :'reason')
       AND (:'error_class'::text = '' OR m.error_class LIKE :'error_class')
       AND (:'since'::text = '' OR m.created_at >= nullif(:'since', '')::timestamptz)
       AND (:'until'::text = '' OR m.created_at < nullif(:'until', '')::timestamptz)
       AND (:'after_id'::text = ''
            OR (k.next_run_at, k.head_id) > (nullif(:'after_at', '')::timestamptz, nullif(:'after_id', '')::bigint))
     ORDER BY k.next_run_at, k.head_id
     LIMIT :limit)
    UNION ALL
    (SELECT m.id,
           m.business_key,
           m.seq,
           m.target_topic,
           m.state,
           m.next_run_at,
           m.attempt,
           m.reason,
           m.error_class,
           m.created_at,
           m.redrive_count
    FROM deferred_message m
    WHERE NOT (:'sort' = 'due' AND :'state' IN ('', 'pending'))
      AND (:'state'::text = '' OR m.state = :'state')
      AND (:'target'::text = '' OR m.target_topic LIKE :'target')
      AND (:'reason'::text = '' OR split_part(m.reason, ':', 1) = :'reason')
      AND (:'error_class'::text = '' OR m.error_class LIKE :'error_class')
      AND (:'since'::text = '' OR m.created_at >= nullif(:'since', '')::timestamptz)
      AND (:'until'::text = '' OR m.created_at < nullif(:'until', '')::timestamptz)
      AND (:'after_id'::text = ''
           OR (:'sort' = 'due' AND (m.next_run_at, m.id) > (nullif(:'after_at', '')::timestamptz, nullif(:'after_id', '')::bigint))
           OR (:'sort' = 'oldest' AND m.id > nullif(:'after_id', '')::bigint)
           OR (:'sort' = 'newest' AND m.id < nullif(:'after_id', '')::bigint))
    ORDER BY CASE WHEN :'sort' = 'due' THEN m.next_run_at END,
             CASE WHEN :'sort' = 'newest' THEN m.id END DESC,
             m.id
    LIMIT :limit)
) p
ORDER BY CASE WHEN :'sort' = 'due' THEN p.next_run_at END,
         CASE WHEN :'sort' = 'newest' THEN p.id END DESC,
         p.id;
