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
-- width, which follows growth.
--
-- A table a VACUUM found empty and truncated (relpages 0, reltuples 0, what
-- autovacuum leaves after a drain) counts as estimated at 0 rows. The
-- planner sizes such a table from its current pages and row width, but its
-- indexes keep their pages with a count of 0 tuples, so a whole index scan
-- looks free; and the service's prepared statements keep the plan they
-- got while the table was nearly empty until an ANALYZE invalidates it.
-- Finalize's delete read every entry of deferred_message_key_order instead
-- of probing the primary key, the claim scanned deferred_key whole, about
-- a second per statement once the queue refilled, and dispatch fell behind
-- for as long as the statistics stayed (docs/benchmarks.md, "A vacuumed
-- queue"). Such a table's rows are counted from its pages too, which
-- follow the refill at once where the statistics lag (migration 0013).
-- Each process calls it every second
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
        CROSS JOIN LATERAL (
            SELECT pg_relation_size(c.oid) / current_setting('block_size')::bigint AS pages
        ) p
        CROSS JOIN LATERAL (
            SELECT CASE WHEN c.relpages > 0 THEN c.reltuples / c.relpages * greatest(p.pages, 1)
                        ELSE c.reltuples END AS estimate,
                   -- The rows it holds. n_live_tup lags by up to a second
                   -- (each backend sends its counts at most once a second);
                   -- a truncated table's pages are all new since its
                   -- VACUUM, so they bound it from below at once (about 25
                   -- messages or 40 heads fit a page; 10 is safe).
                   greatest(s.n_live_tup, CASE WHEN c.relpages = 0 THEN 10 * p.pages ELSE 0 END) AS live
        ) e
        WHERE c.oid IN ('deferred_message'::regclass, 'deferred_key'::regclass)
          AND c.reltuples >= 0
          AND e.live > min_rows
          AND e.live > 2 * e.estimate
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
