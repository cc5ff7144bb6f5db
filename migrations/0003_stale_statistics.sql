-- Plans that survive stale statistics.
--
-- A queue table is analyzed at its worst moment: autovacuum sees it nearly
-- empty right after a drain, over pages that held rows, and records a density
-- of about zero rows per page. When a burst of deferrals then fills it, the
-- planner still takes any unqualified scan of deferred_key or
-- deferred_message to return one row, until the next analyze. Statements
-- that join the batch to one of those tables could then be planned as a
-- nested loop around a full index scan of the table: the table's size times
-- the batch's, per statement. Seen at 23 s for one finalize of 500 keys among
-- 100,000 (a scan of every key for each of them), and as the benchmark's
-- occasional collapse of the database ceiling to about 1,100 msgs/s.
--
-- Every such statement now names its rows by an array of keys or ids that
-- an index scan takes directly (deferred_key_business_key, deferred_key_head_id
-- or the primary key), so that the table is read only where the batch is,
-- whatever the statistics say. What the statements do is unchanged. The
-- statements the service sends itself get the same bound in sql/
-- (dispatch_park.sql, dlq_back_off.sql, dlq_mark_published.sql), and
-- internal/keylock's TestStaleStatisticsKeepWorkProportionalToBatch checks
-- each hot path in exactly that state by the rows it reads.

CREATE OR REPLACE FUNCTION deferred_key_refresh(keys text[], unordered_ids bigint[]) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    earliest timestamptz;
    earliest_unordered timestamptz;
    throttling text[];
BEGIN
    IF cardinality(keys) > 0 THEN
        INSERT INTO deferred_key AS d (business_key, head_id, head_seq, next_run_at)
        SELECT k, 0, 0, 'infinity' FROM unnest(keys) AS k ORDER BY k
        ON CONFLICT (business_key) DO UPDATE SET head_id = d.head_id WHERE false;
    END IF;
    IF cardinality(keys) > 0 OR cardinality(unordered_ids) > 0 THEN
        throttling := deferred_key_throttle_share(NULL);
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
    IF cardinality(unordered_ids) > 0 THEN
        -- An array rather than NOT EXISTS: the anti-join was planned as a
        -- walk of deferred_message per head.
        DELETE FROM deferred_key d
        WHERE d.business_key IS NULL AND d.head_id = ANY (unordered_ids)
          AND d.head_id <> ALL (ARRAY(
              SELECT m.id FROM deferred_message m
              WHERE m.id = ANY (unordered_ids) AND m.state = 'pending' AND m.business_key IS NULL));

        WITH cur AS (
            SELECT m.id, m.seq, m.next_run_at, m.target_topic,
                   m.target_topic = ANY (throttling)
                       AND EXISTS (SELECT 1 FROM target_control c
                                   WHERE c.target_topic = m.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
                       AS throttled
            FROM deferred_message m
            WHERE m.id = ANY (unordered_ids) AND m.state = 'pending' AND m.business_key IS NULL
        ), moved AS (
            UPDATE deferred_key d
            SET head_seq = m.seq, next_run_at = m.next_run_at, head_target = m.target_topic, throttled = m.throttled
            FROM cur m
            WHERE d.business_key IS NULL AND d.head_id = ANY (unordered_ids) AND d.head_id = m.id
              AND (d.head_seq, d.next_run_at, d.head_target, d.throttled)
                  IS DISTINCT FROM (m.seq, m.next_run_at, m.target_topic, m.throttled)
            RETURNING d.next_run_at, d.leased_until
        ), added AS (
            INSERT INTO deferred_key (business_key, head_id, head_seq, next_run_at, head_target, throttled)
            SELECT NULL, m.id, m.seq, m.next_run_at, m.target_topic, m.throttled
            FROM cur m
            WHERE NOT EXISTS (SELECT 1 FROM deferred_key d
                              WHERE d.business_key IS NULL AND d.head_id = ANY (unordered_ids) AND d.head_id = m.id)
            RETURNING next_run_at, leased_until
        )
        SELECT min(next_run_at) INTO earliest_unordered
        FROM (SELECT * FROM moved UNION ALL SELECT * FROM added) c
        WHERE leased_until IS NULL OR leased_until <= now();
    END IF;

    PERFORM deferred_key_notify(least(earliest, earliest_unordered));
END
$$;

-- The rewritten statements bound the damage; only fresh statistics prevent
-- it. Autovacuum analyzes a table once per autovacuum_naptime at best (a
-- minute by default), and a burst of deferrals can grow the queue a
-- hundredfold in that time. deferred_queue_analyze analyzes deferred_message
-- and deferred_key when the rows they hold (pg_stat_user_tables.n_live_tup)
-- exceed both min_rows and twice the planner's estimate (pg_class's density
-- times the table's current size, which is what the planner computes). A
-- table never analyzed is left alone: the planner then estimates from the
-- size and the row width, which follows growth. Each process calls it every
-- few seconds (internal/keylock.AnalyzeIfStale); as a queue grows it
-- analyzes about once per doubling, and never while the estimate holds.
--
-- It runs as its owner (SECURITY DEFINER, search_path pinned to the
-- migration's): ANALYZE needs the table's owner, and the service role is
-- not (sql/roles). A table another ANALYZE or a VACUUM holds is skipped
-- after lock_timeout rather than waited for: the next call will do.
-- Returns the tables analyzed.
CREATE FUNCTION deferred_queue_analyze(min_rows bigint) RETURNS text[]
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET lock_timeout = '200ms'
AS $$
DECLARE
    t record;
    analyzed text[] := '{}';
BEGIN
    FOR t IN
        SELECT c.oid::regclass AS rel, c.relname::text AS name
        FROM pg_class c
        JOIN pg_stat_user_tables s ON s.relid = c.oid
        WHERE c.oid IN ('deferred_message'::regclass, 'deferred_key'::regclass)
          AND c.relpages > 0 AND c.reltuples >= 0
          AND s.n_live_tup > min_rows
          AND s.n_live_tup > 2 * c.reltuples / c.relpages
                             * greatest(pg_relation_size(c.oid) / current_setting('block_size')::bigint, 1)
        ORDER BY c.relname
    LOOP
        BEGIN
            EXECUTE format('ANALYZE %s', t.rel);
            analyzed := analyzed || t.name;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END LOOP;
    RETURN analyzed;
END
$$;
