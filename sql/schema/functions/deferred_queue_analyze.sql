-- deferred_queue_analyze: statistics that follow a growing queue.
--
-- A queue table is analyzed at its worst moment (see deferred_key_refresh),
-- and only fresh statistics prevent bad plans. Autovacuum analyzes a table
-- once per autovacuum_naptime at best (a minute by default), and a burst of
-- deferrals can grow the queue a hundredfold in that time.
-- deferred_queue_analyze analyzes deferred_message and deferred_key when the
-- rows they hold (pg_stat_user_tables.n_live_tup) exceed both min_rows and
-- twice the planner's estimate (pg_class's density times the table's
-- current size, which is what the planner computes). A table never analyzed
-- is left alone: the planner then estimates from the size and the row
-- width, which follows growth. Each process calls it every few seconds
-- (internal/keylock.AnalyzeIfStale); as a queue grows it analyzes about once
-- per doubling, and never while the estimate holds.
--
-- It runs as its owner (SECURITY DEFINER, search_path pinned to the
-- migration's): ANALYZE needs the table's owner, and the service role is
-- not (sql/roles). A table another ANALYZE or a VACUUM holds is skipped
-- after lock_timeout rather than waited for: the next call will do.
-- Returns the tables analyzed.

CREATE OR REPLACE FUNCTION deferred_queue_analyze(min_rows bigint) RETURNS text[]
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
