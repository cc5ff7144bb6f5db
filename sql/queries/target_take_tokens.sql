-- Take tokens from the rate-limit buckets of targets $1 (text[]), at most $2
-- (int) from each, for targets that have a due head nobody holds; one token
-- is one message (dispatch_claim_target.sql claims one message per head).
-- Returns, for each such target: how many tokens were taken (0 when the
-- bucket holds less than one), and how many seconds until the bucket holds a
-- whole token again after this take (0 if it still does). Targets without
-- due work, not limited or paused return no row and are not touched.
--
-- Dispatch runs it only for targets that target_peek_tokens.sql found with a
-- token or more: it locks and writes the target's row.
--
-- The bucket (target_control.tokens, refilled_at) is shared by every loop of
-- every replica: it refills at rate_limit tokens per second since
-- refilled_at, up to one second's worth (at least one token), and starts
-- full. Unused tokens go back with target_return_tokens.sql.
--
-- The row is locked (in target order, as target_return_tokens.sql does)
-- before the level is computed, and clock_timestamp() is read under the
-- lock: a concurrent take that committed first is seen (READ COMMITTED
-- re-evaluates a locked row on its newest version), and time stamps only
-- ever move forward, so no second of refill is counted twice. A bucket with
-- less than a token left is not written at all: its refill keeps
-- accumulating from refilled_at.
WITH cur AS MATERIALIZED (
    SELECT c.target_topic, c.rate_limit, clock_timestamp() AS at,
           CASE WHEN c.refilled_at IS NULL THEN greatest(c.rate_limit, 1)
                ELSE least(greatest(c.rate_limit, 1),
                           c.tokens + c.rate_limit
                               * greatest(extract(epoch FROM clock_timestamp() - c.refilled_at)::float8, 0))
           END AS level
    FROM target_control c
    WHERE c.target_topic = ANY ($1::text[]) AND c.rate_limit IS NOT NULL AND NOT c.paused
      AND EXISTS (SELECT 1 FROM deferred_key k
                  WHERE k.throttled AND k.head_target = c.target_topic AND k.next_run_at <= now()
                    AND (k.leased_until IS NULL OR k.leased_until <= now()))
    ORDER BY c.target_topic
    FOR NO KEY UPDATE OF c
), granted AS (
    SELECT target_topic, rate_limit, at, level, floor(least(level, $2::int))::int AS taken
    FROM cur
), took AS (
    UPDATE target_control c
    SET tokens = g.level - g.taken, refilled_at = g.at
    FROM granted g
    WHERE c.target_topic = g.target_topic AND g.taken > 0
)
SELECT target_topic, taken, (greatest(1 - (level - taken), 0) / rate_limit)::float8 AS next_token_seconds
FROM granted
ORDER BY target_topic
