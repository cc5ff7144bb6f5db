-- The targets an express round claims (dispatch_claim_express.sql): those
-- with at most $1 due heads, light, provided some target has more, a
-- backlog. Without a backlog it returns none: the main claims are short
-- then, and small claims beside them would only cost (docs/design.md 4.4,
-- "Express claims").
--
-- A target's due heads are counted leased or not, at most $1 + 1 of them,
-- in due order from deferred_key_target_due (paused and rate-limited
-- targets' heads are not in it): a few index entries per target, however
-- long its backlog, and without walking past the heads the loops hold
-- (counting only the free ones walked every leased head first: 2,000 of
-- them, 9 ms, when four loops held rounds of 500). A target whose heads
-- are all in flight in a drain's rounds still counts as a backlog. The
-- order puts the count on that index: without it, the planner read
-- deferred_key from its start and walked every other target's heads.
WITH counted AS MATERIALIZED (
    SELECT t.target,
           (SELECT count(*)
            FROM (SELECT
                  FROM deferred_key k
                  WHERE NOT k.throttled
                    AND k.head_target = t.target
                    AND k.next_run_at <= now()
                  ORDER BY k.next_run_at
                  LIMIT $1 + 1) n) AS heads
    FROM deferred_key_target t
)
SELECT c.target
FROM counted c
WHERE c.heads BETWEEN 1 AND $1
  AND EXISTS (SELECT FROM counted b WHERE b.heads > $1)
ORDER BY c.target
