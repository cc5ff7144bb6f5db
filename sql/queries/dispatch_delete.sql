-- Finalize, step 4: the broker acknowledged these messages; forget them, and
-- record where each went. $1 are the messages' ids; $2 and $3, one per id,
-- the partition and offset of its target the broker put it at (both NULL
-- where unknown); $4, one per id, when the claim that read it ran (its
-- claimed_at; NULL where unknown: now()).
--
-- A message still pending is deleted (one an operator parked meanwhile
-- stays parked), and for each:
--   - a 'published' event in deferred_attempt, in its lineage, with the
--     attempt the record carries (the stored one plus one) and where it
--     went, so that a message's story ends with its delivery. It is
--     recorded at the claim ($4), not at this statement's now(): the
--     record went out after the claim, and a consumer may have read it,
--     re-deferred it and ingest stored that before this finalize began,
--     so only a time before the publish keeps the delivery ahead of what
--     it caused when the history is read by recorded_at. A message
--     with no history yet (stored pending and left alone since, nearly
--     all: migration 0012) has its deferral folded into that one row:
--     deferred_at (its created_at) and the error it was deferred for
--     (error_class, error_message), which the view deferred_history shows
--     as its 'deferred' event. Its lineage is then its origin's, as
--     deferred_lineage names it (a call for re-deferrals only);
--   - if it names a consumer group and a business key (defer.group), its
--     key in deferred_inflight for that group and target partition, the
--     key's last record there winning: the key stays blocked for the
--     group's key-state queries until the group's committed offset passes
--     it (docs/design.md section 23). Rows are written in primary-key order,
--     the order the release deletes them in.
--   - the key itself is leased 'in-flight' (below).
-- One statement, so that the key is never seen free between the delete and
-- the in-flight row: both commit with the rest of the finalize.
--
-- (m.state = 'pending') IS TRUE, not m.state = 'pending' (state is NOT
-- NULL: the same rows): written plainly, it implies the predicate of the
-- partial index deferred_message_key_order, and with statistics taken
-- while the queue was nearly empty the planner costed a scan of that whole
-- index at next to nothing and ANDed it with the primary key's probes:
-- every finalize read all pending messages' entries and their pages (1,779
-- pages for 500 ids among 20,000, 25 ms against 2 ms; docs/benchmarks.md,
-- "Finalize by the primary key"). IS TRUE keeps the same estimate but
-- proves nothing about the partial index, so the ids are found by the
-- primary key whatever the statistics say.
WITH gone AS (
    DELETE FROM deferred_message m
    WHERE m.id = ANY ($1::bigint[]) AND (m.state = 'pending') IS TRUE
    RETURNING m.id, m.business_key, m.seq, m.group_id, m.target_topic, m.attempt, m.next_run_at,
              m.origin_id, m.created_at, m.error_class, m.error_message
), placed AS (
    SELECT g.id, g.business_key, g.seq, g.group_id, g.target_topic, g.attempt, g.next_run_at,
           g.origin_id, g.created_at, g.error_class, g.error_message,
           p.partition, p.record_offset, p.claimed_at
    FROM gone g
    LEFT JOIN unnest($1::bigint[], $2::int[], $3::bigint[], $4::timestamptz[])
        AS p (id, partition, record_offset, claimed_at) ON p.id = g.id
), history AS (
    INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, target_topic, next_run_at,
                                  partition, record_offset, deferred_at, error_class, error_message, recorded_at)
    -- One probe of deferred_attempt_message per message: its first event
    -- names its lineage; a message without one folds its deferral in.
    SELECT coalesce(f.lineage_id,
                    CASE WHEN p.origin_id IS NOT NULL THEN deferred_lineage(p.origin_id) ELSE p.id END),
           p.id, 'published', p.attempt + 1, p.target_topic, p.next_run_at, p.partition, p.record_offset,
           CASE WHEN f.lineage_id IS NULL THEN p.created_at END,
           CASE WHEN f.lineage_id IS NULL THEN p.error_class END,
           CASE WHEN f.lineage_id IS NULL THEN p.error_message END,
           coalesce(p.claimed_at, now())
    FROM placed p
    LEFT JOIN LATERAL (SELECT a.lineage_id FROM deferred_attempt a
                       WHERE a.message_id = p.id ORDER BY a.message_id, a.id LIMIT 1) f ON true
    ORDER BY p.id
), flight AS (
    INSERT INTO deferred_inflight AS i (group_id, business_key, target_topic, partition, record_offset, message_id, seq)
    SELECT l.group_id, l.business_key, l.target_topic, l.partition, l.record_offset, l.id, l.seq
    FROM (
        SELECT DISTINCT ON (p.group_id, p.business_key, p.target_topic, p.partition) p.*
        FROM placed p
        WHERE p.group_id IS NOT NULL AND p.business_key IS NOT NULL AND p.partition IS NOT NULL
        ORDER BY p.group_id, p.business_key, p.target_topic, p.partition, p.record_offset DESC
    ) l
    ORDER BY l.group_id, l.business_key, l.target_topic, l.partition
    ON CONFLICT (group_id, business_key, target_topic, partition) DO UPDATE
    SET record_offset = excluded.record_offset, message_id = excluded.message_id, seq = excluded.seq,
        published_at = now()
    WHERE excluded.record_offset >= i.record_offset
)
-- The keys now in flight take the lease 'in-flight' until 'infinity': no
-- dispatcher claims them until their group committed past what went out
-- (deferred_inflight_after_delete.sql clears it). The finalize holds their
-- rows locked (dispatch_lock_keys.sql), and its release after this
-- (dispatch_release.sql) frees only keys still leased to it; the head
-- trigger this delete fires runs after this statement, and keeps the row of
-- a key left without messages, emptied, since another holder ('in-flight')
-- leases it.
UPDATE deferred_key k
SET leased_by = 'in-flight', leased_until = 'infinity'
WHERE k.business_key = ANY (ARRAY(SELECT DISTINCT p.business_key FROM placed p
                                  WHERE p.group_id IS NOT NULL AND p.business_key IS NOT NULL
                                    AND p.partition IS NOT NULL))
