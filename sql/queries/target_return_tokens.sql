-- Give back tokens taken with target_take_tokens.sql and not used: $2 (int[])
-- tokens to each target of $1 (text[]), capped at the bucket's size (one
-- second's worth, at least one token). Rows are locked in target order first,
-- as target_take_tokens.sql does, so concurrent takes and returns queue
-- instead of deadlocking. A target whose limit was removed meanwhile is left
-- alone.
WITH locked AS MATERIALIZED (
    SELECT target_topic
    FROM target_control
    WHERE target_topic = ANY ($1::text[]) AND rate_limit IS NOT NULL
    ORDER BY target_topic
    FOR NO KEY UPDATE
)
UPDATE target_control c
SET tokens = least(greatest(c.rate_limit, 1), c.tokens + r.n)
FROM locked l
JOIN unnest($1::text[], $2::int[]) AS r (target_topic, n) ON r.target_topic = l.target_topic
WHERE c.target_topic = l.target_topic AND c.rate_limit IS NOT NULL AND r.n > 0
