-- One page of consumer group $1's blocked keys (docs/design.md, "The
-- blocked-key set"): up to $3 (int) keys after $2 in byte order ('' for the
-- first page), each with its state as deferred_key_state gives it, and
-- cursor, the feed position to follow the set from (key_changes.sql).
-- Always one row at least: with no key left, a row whose business_key and
-- state are NULL carries the cursor.
--
-- cursor is the xmin of this statement's snapshot: every transaction below
-- it had ended when the keys were read, so their changes are in this page,
-- and every change after it has a transaction id at or above it (it was
-- running then, or began later), where the feed finds it. A client keeps
-- the first page's cursor: what changed between pages comes again from the
-- feed. A key is blocked for the group when a message of the group's is
-- pending, parked holding its key, or rejected, or when it is in flight:
-- both sources are read by group and key, each by its index
-- (deferred_message_group_key, deferred_inflight's primary key).
WITH keys AS (
    SELECT u.business_key
    FROM (
        -- deferred_message_group_key: the group's blocking messages, by key.
        (SELECT DISTINCT m.business_key
         FROM deferred_message m
         WHERE m.group_id = $1 AND m.business_key > $2::text
           AND (m.state IN ('pending', 'rejected') OR (m.state = 'parked' AND m.park_holds_key))
         ORDER BY m.business_key
         LIMIT $3)
        UNION
        (SELECT DISTINCT i.business_key
         FROM deferred_inflight i
         WHERE i.group_id = $1 AND i.business_key > $2::text
         ORDER BY i.business_key
         LIMIT $3)
    ) u
    ORDER BY u.business_key
    LIMIT $3
)
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS cursor,
       s.business_key, s.blocked, s.reason, s.head_seq, s.head_id
FROM (SELECT 1) one
LEFT JOIN LATERAL deferred_key_state($1, ARRAY(SELECT business_key FROM keys ORDER BY business_key)) s ON true
