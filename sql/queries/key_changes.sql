-- What changed in consumer group $1's blocked keys since cursor $2 (bigint,
-- from key_set.sql or an earlier call), and the state now of the keys in
-- $3 (text[]) besides: one row per key, with its state as
-- deferred_key_state gives it, each carrying the new cursor, reset, the
-- ingest positions of topic $4 (the defer topic) as stored_partitions and
-- stored_offsets, and behind_ms. Always one row at least: with no
-- key, a row whose business_key and state are NULL carries the rest.
--
-- The changes read are those of deferred_key_change whose transaction id
-- is at or above the cursor and below this statement's snapshot's xmin,
-- which becomes the new cursor. Below the xmin every transaction has ended,
-- so nothing can still commit there; a number taken from a sequence would
-- not do, since a transaction that took a lower one may commit after one
-- that took a higher one. Reading by xid, a change waits until every older
-- transaction has ended, never longer.
--
-- reset: the set cannot be followed from this cursor, and the caller must
-- load it again (key_set.sql): changes at or above the cursor may be gone
-- (deferred_key_change_pruned), the cursor is ahead of the database (it
-- went back in time, or the cursor is another database's), or more than
-- $5 (int) keys changed. No key rows then.
--
-- behind_ms is how long the oldest change the answer could not give yet
-- (committed at or above the new cursor) has waited, in milliseconds, 0
-- for none: a transaction left open anywhere in the cluster holds every
-- later change back, and a client then stops trusting its set.
--
-- The positions are read in the same snapshot as the states: a record
-- below them was stored, so the state of its key in $3 includes it. A
-- client keeps its own deferrals blocked until then. $6 (int[]) and $7
-- (bigint[]), when given, pair each key of $3 with the partition and
-- offset of the client's deferral: a key is answered only once ingest has
-- stored past it, so that a deferral costs one state read, not one per
-- question until it is stored.
WITH h AS (
    SELECT pg_snapshot_xmin(pg_current_snapshot()) AS horizon,
           $2::bigint::text::xid8 AS cursor,
           coalesce((SELECT p.below FROM deferred_key_change_pruned p), '0'::xid8) AS below
), changed AS (
    SELECT DISTINCT c.business_key
    FROM deferred_key_change c, h
    WHERE c.group_id = $1 AND c.xid >= h.cursor AND c.xid < h.horizon
    LIMIT $5::int + 1
), head AS (
    SELECT h.horizon::text::bigint AS cursor,
           (h.cursor <= h.below OR h.cursor > h.horizon OR (SELECT count(*) FROM changed) > $5::int) AS reset,
           ARRAY(SELECT o.partition FROM ingest_offset o WHERE o.topic = $4 ORDER BY o.partition) AS stored_partitions,
           ARRAY(SELECT o.next_offset FROM ingest_offset o WHERE o.topic = $4 ORDER BY o.partition) AS stored_offsets,
           (SELECT coalesce(floor(extract(epoch FROM now() - min(c.changed_at)) * 1000), 0)::bigint
            FROM deferred_key_change c
            WHERE c.group_id = $1 AND c.xid >= h.horizon) AS behind_ms
    FROM h
)
SELECT head.cursor, head.reset, head.stored_partitions, head.stored_offsets, head.behind_ms,
       s.business_key, s.blocked, s.reason, s.head_seq, s.head_id
FROM head
LEFT JOIN LATERAL deferred_key_state($1, ARRAY(
    SELECT a.k
    FROM unnest($3::text[], $6::int[], $7::bigint[]) AS a (k, p, o)
    WHERE a.p IS NULL
       OR EXISTS (SELECT FROM ingest_offset io WHERE io.topic = $4 AND io.partition = a.p AND io.next_offset > a.o)
    UNION
    SELECT business_key FROM changed
)) s ON NOT head.reset
