-- Look, without locking or writing, at the rate-limit buckets of targets $1
-- (text[]) that have a due head nobody holds: returns each one's current
-- level (tokens available now, fractional) and its rate_limit. Targets not
-- limited, paused or without due work return no row. Due work is looked for
-- in deferred_key_throttled, among the target's own heads only, the ones
-- dispatch_claim_target.sql can claim.
--
-- Dispatch looks before it takes (target_take_tokens.sql) so that a round
-- that finds less than a token, the common case of a target at its limit,
-- writes nothing: no row lock that every loop of every replica queues on,
-- no dead row version per round. The level is computed exactly as
-- target_take_tokens.sql computes it.
SELECT c.target_topic, c.rate_limit,
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
