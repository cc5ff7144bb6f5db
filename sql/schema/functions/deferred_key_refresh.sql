-- deferred_key_refresh recomputes the heads of the given business keys and
-- unordered message ids after rows were updated or deleted.
--
-- Correctness under concurrency (READ COMMITTED): each statement below takes
-- a new snapshot. The first locks the head row of every affected key, in key
-- order, creating a placeholder where none exists. It must be one upsert: ON
-- CONFLICT DO UPDATE locks the row even when its WHERE is false, and if the
-- row is deleted while we wait for it, the insert is retried, so no key is
-- ever left unlocked (a plain SELECT ... FOR UPDATE silently skips a row
-- deleted meanwhile). A concurrent insert of the same key locks or inserts
-- that row too, so it is ordered before or after us; the recompute then runs
-- on a snapshot taken after the locks and sees every message committed
-- before us. Leases are kept: they belong to the key.
--
-- Head candidates are pending messages and parked messages that hold their
-- key; a held head's next_run_at is 'infinity'; throttled is set as in
-- deferred_key_throttle_share.sql.
--
-- A key left without candidates loses its row, unless a dispatcher holds
-- its lease: an operator cancelled or parked (with release) its last
-- message while it was being published. The row then stays, emptied
-- (head_id 0, head_seq the largest bigint, 'infinity'), with its lease:
-- a message ingested meanwhile takes it over as head (any seq is lower)
-- under the holder's lease, and waits for the holder's finalize, which
-- deletes the row if it is still empty (dispatch_release_empty.sql), or
-- for the lease to run out (lease_sweep.sql). Deleting it here let a
-- second dispatcher claim such a message while the first was still
-- publishing (migration 0006). A key the transaction's own finalize holds
-- (scheduler.finalizing, set by dispatch_finalizing.sql) is deleted as
-- before: the finalize releases it after its changes.
--
-- A key stops being held when an operator replays or deletes the parked
-- message at its head (or a re-deferral lands ahead of it). Whatever befell
-- the key before it was held is history then: the finalize that parked the
-- head may also have recorded a retriable failure of a later message of the
-- key (failures + 1, a back-off lease owned by no one), and the replayed
-- head must not wait for that back-off, up to BackoffMax. So the failure
-- count restarts at 0 and a lease owned by no one (a back-off, or expired)
-- is cleared; a lease a dispatcher holds is kept, it belongs to the key.
--
-- Plans that survive stale statistics (migration 0003): a queue table is
-- analyzed at its worst moment, nearly empty right after a drain, and the
-- planner then takes any unqualified scan of deferred_key or
-- deferred_message to return one row until the next analyze; a join of the
-- batch to it could become a nested loop around a full index scan (seen at
-- 23 s for one finalize of 500 keys among 100,000). Every statement here
-- therefore names its rows by an array of keys or ids that an index scan
-- takes directly (deferred_key_business_key, deferred_key_head_id or the
-- primary key), so that the table is read only where the batch is, whatever
-- the statistics say. internal/keylock's
-- TestStaleStatisticsKeepWorkProportionalToBatch checks it.
--
-- plan_cache_mode = auto: PL/pgSQL keeps each statement's plan for the
-- life of the connection, and after five calls uses a generic plan (made
-- without the actual arrays) when it costs no more than the custom ones
-- did. Until migration 0015 this function forced a custom plan per call,
-- as the trigger functions still do: a generic plan of an earlier version
-- joined deferred_key by a full scan and kept doing so at a million keys
-- (docs/benchmarks.md, "What the numbers say"). Every statement now names
-- its rows by arrays that an index takes directly (above), so a generic
-- plan reads in proportion to the batch whatever the statistics said when
-- it was made (TestStaleStatisticsKeepWorkProportionalToBatch runs every
-- step with this function forced to generic plans, and to custom ones);
-- and planning the head update on every call cost three times what
-- running it did at the 20-50 messages a round holds at 5,000 msgs/s.
-- Set here rather than left to the caller: the trigger functions that
-- call it force custom plans for their own statements, and a function's
-- SET would otherwise hold inside this one too.

CREATE OR REPLACE FUNCTION deferred_key_refresh(keys text[], unordered_ids bigint[]) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = auto
AS $$
DECLARE
    earliest timestamptz;
    earliest_unordered timestamptz;
    throttling text[] := '{}';
    -- The lease holder whose finalize runs this transaction, if any.
    finalizing text := nullif(current_setting('scheduler.finalizing', true), '');
BEGIN
    IF cardinality(keys) > 0 THEN
        INSERT INTO deferred_key AS d (business_key, head_id, head_seq, next_run_at)
        SELECT k, 0, 0, 'infinity' FROM unnest(keys) AS k ORDER BY k
        ON CONFLICT (business_key) DO UPDATE SET head_id = d.head_id WHERE false;
    END IF;
    -- Only the targets of the heads about to be written are asked about
    -- (migration 0017): each target locked is a shared advisory lock held
    -- to the end of the transaction, and asking about every throttled
    -- target made each finalize hold one per paused or rate-limited target,
    -- so that some thousands of them filled the lock table ("out of shared
    -- memory") and every finalize failed. Reading the heads' targets first
    -- costs a second probe per key, paid only while some target is
    -- throttled. A head whose target changes between this read and the
    -- heads below is left unflagged, which is safe (see
    -- deferred_key_throttle_share.sql).
    IF (cardinality(keys) > 0 OR cardinality(unordered_ids) > 0)
       AND EXISTS (SELECT 1 FROM target_control c WHERE c.paused OR c.rate_limit IS NOT NULL) THEN
        throttling := deferred_key_throttle_share(ARRAY(
            SELECT m.target_topic
            FROM unnest(keys) AS k (business_key)
            CROSS JOIN LATERAL (
                SELECT m.target_topic FROM deferred_message m
                WHERE m.business_key = k.business_key
                  AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key))
                ORDER BY m.seq, m.id
                LIMIT 1
            ) m
            UNION
            SELECT m.target_topic FROM deferred_message m
            WHERE m.id = ANY (unordered_ids) AND (m.state = 'pending') IS TRUE AND m.business_key IS NULL));
    END IF;

    IF cardinality(keys) > 0 THEN
        WITH heads AS (
            SELECT k.business_key, m.id, m.seq, m.target_topic,
                   m.state = 'parked' AS held,
                   m.state = 'pending' AND m.target_topic = ANY (throttling)
                       AND EXISTS (SELECT 1 FROM target_control c
                                   WHERE c.target_topic = m.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
                       AS throttled,
                   CASE WHEN m.state = 'parked' THEN 'infinity' ELSE m.next_run_at END AS next_run_at
            FROM unnest(keys) AS k (business_key)
            LEFT JOIN LATERAL (
                SELECT id, seq, next_run_at, target_topic, state FROM deferred_message m
                WHERE m.business_key = k.business_key
                  AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key))
                ORDER BY m.seq, m.id
                LIMIT 1
            ) m ON true
        ), gone AS (
            DELETE FROM deferred_key d
            WHERE d.business_key = ANY (ARRAY(SELECT g.business_key FROM heads g WHERE g.id IS NULL))
              AND NOT (d.leased_by IS NOT NULL AND d.leased_until > now() AND d.leased_by IS DISTINCT FROM finalizing)
        ), emptied AS (
            UPDATE deferred_key d
            SET head_id = 0, head_seq = 9223372036854775807, next_run_at = 'infinity', head_target = NULL,
                held = false, throttled = false
            WHERE d.business_key = ANY (ARRAY(SELECT g.business_key FROM heads g WHERE g.id IS NULL))
              AND d.leased_by IS NOT NULL AND d.leased_until > now() AND d.leased_by IS DISTINCT FROM finalizing
              AND d.head_id <> 0
        ), moved AS (
            UPDATE deferred_key d
            SET head_id = h.id, head_seq = h.seq, next_run_at = h.next_run_at, head_target = h.target_topic,
                held = h.held, throttled = h.throttled,
                failures = CASE WHEN d.held AND NOT h.held THEN 0 ELSE d.failures END,
                leased_until = CASE WHEN d.held AND NOT h.held AND d.leased_by IS NULL THEN NULL
                                    ELSE d.leased_until END
            FROM heads h
            WHERE d.business_key = ANY (ARRAY(SELECT g.business_key FROM heads g WHERE g.id IS NOT NULL))
              AND d.business_key = h.business_key AND h.id IS NOT NULL
              AND (d.head_id, d.head_seq, d.next_run_at, d.head_target, d.held, d.throttled)
                  IS DISTINCT FROM (h.id, h.seq, h.next_run_at, h.target_topic, h.held, h.throttled)
            RETURNING d.next_run_at, d.leased_until
        )
        SELECT min(next_run_at) INTO earliest FROM moved
        WHERE leased_until IS NULL OR leased_until <= now();
    END IF;

    -- Unordered messages hold no key, so parking one simply removes its head.
    -- Their rows and heads are found by id (the primary key,
    -- deferred_key_head_id), whatever the statistics say (migration 0014):
    -- "(m.state = 'pending') IS TRUE" selects the same rows as "m.state =
    -- 'pending'" (state is NOT NULL) without implying the predicate of
    -- deferred_message_key_order, and "(d.business_key IS NULL) IS TRUE" the
    -- same heads as "d.business_key IS NULL" without being a condition on
    -- deferred_key_business_key. Written plainly, stale statistics made the
    -- planner AND in a scan of every unordered entry of either index.
    IF cardinality(unordered_ids) > 0 THEN
        -- An array rather than NOT EXISTS: the anti-join was planned as a
        -- walk of deferred_message per head.
        DELETE FROM deferred_key d
        WHERE (d.business_key IS NULL) IS TRUE AND d.head_id = ANY (unordered_ids)
          AND d.head_id <> ALL (ARRAY(
              SELECT m.id FROM deferred_message m
              WHERE m.id = ANY (unordered_ids) AND (m.state = 'pending') IS TRUE AND m.business_key IS NULL));

        WITH cur AS (
            SELECT m.id, m.seq, m.next_run_at, m.target_topic,
                   m.target_topic = ANY (throttling)
                       AND EXISTS (SELECT 1 FROM target_control c
                                   WHERE c.target_topic = m.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
                       AS throttled
            FROM deferred_message m
            WHERE m.id = ANY (unordered_ids) AND (m.state = 'pending') IS TRUE AND m.business_key IS NULL
        ), moved AS (
            UPDATE deferred_key d
            SET head_seq = m.seq, next_run_at = m.next_run_at, head_target = m.target_topic, throttled = m.throttled
            FROM cur m
            WHERE (d.business_key IS NULL) IS TRUE AND d.head_id = ANY (unordered_ids) AND d.head_id = m.id
              AND (d.head_seq, d.next_run_at, d.head_target, d.throttled)
                  IS DISTINCT FROM (m.seq, m.next_run_at, m.target_topic, m.throttled)
            RETURNING d.next_run_at, d.leased_until
        ), added AS (
            INSERT INTO deferred_key (business_key, head_id, head_seq, next_run_at, head_target, throttled)
            SELECT NULL, m.id, m.seq, m.next_run_at, m.target_topic, m.throttled
            FROM cur m
            WHERE NOT EXISTS (SELECT 1 FROM deferred_key d
                              WHERE (d.business_key IS NULL) IS TRUE AND d.head_id = ANY (unordered_ids) AND d.head_id = m.id)
            RETURNING next_run_at, leased_until
        )
        SELECT min(next_run_at) INTO earliest_unordered
        FROM (SELECT * FROM moved UNION ALL SELECT * FROM added) c
        WHERE leased_until IS NULL OR leased_until <= now();
    END IF;

    PERFORM deferred_key_notify(least(earliest, earliest_unordered));
END
$$;
