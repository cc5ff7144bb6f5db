-- How long until the earliest head that no one holds is due, in seconds by
-- the database clock (0 if already due; no row if nothing is pending).
-- Measured by the database so that clock skew between hosts cannot make a
-- dispatcher sleep past a due time. No parameters.
--
-- The earliest of two reads, neither of which walks a blocked backlog:
--   - deferred_key_due from its start, skipping leased heads: the heads that
--     are neither paused nor rate-limited (deferred_key.throttled). The
--     target_control check is the main claim's safety net (and written as
--     it is, see dispatch_claim.sql) for a head left unflagged by a race
--     with an operator's pause or limit (migration 0002), which would
--     otherwise count as due forever.
--   - for each rate-limited target that is not paused, its earliest head not
--     yet due, from deferred_key_throttled: due heads of such targets go at
--     the pace of their tokens, not of due times, but a future one counts so
--     that the loop wakes when it comes due. Paused targets' heads never
--     count.
--
-- Keys held by a parked message have next_run_at = 'infinity': they are
-- never due, and the range stops before them (and 'infinity' minus a time
-- is an error before Postgres 16, +Inf after).
SELECT greatest(extract(epoch FROM min(next_run_at) - clock_timestamp()), 0)::float8 AS seconds
FROM (
    (SELECT k.next_run_at
     FROM deferred_key k
     WHERE NOT k.throttled
       AND k.next_run_at < 'infinity'
       AND (k.leased_until IS NULL OR k.leased_until <= now())
       -- coalesce: see dispatch_claim.sql.
       AND coalesce(k.head_target <> ALL (ARRAY(SELECT c.target_topic FROM target_control c
                                                WHERE c.paused OR c.rate_limit IS NOT NULL)), false)
     ORDER BY k.next_run_at
     LIMIT 1)
    UNION ALL
    SELECT f.next_run_at
    FROM target_control c
    CROSS JOIN LATERAL (
        SELECT k.next_run_at
        FROM deferred_key k
        WHERE k.throttled
          AND k.head_target = c.target_topic
          AND k.next_run_at > now()
          AND k.next_run_at < 'infinity'
          AND (k.leased_until IS NULL OR k.leased_until <= now())
        ORDER BY k.next_run_at
        LIMIT 1
    ) f
    WHERE c.rate_limit IS NOT NULL AND NOT c.paused
) n
HAVING min(next_run_at) IS NOT NULL
