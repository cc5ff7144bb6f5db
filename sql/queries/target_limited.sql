-- The targets whose dispatch is rate-limited now: a rate_limit is set and the
-- target is not paused (a paused target sends nothing anyway). No
-- parameters. Each dispatch loop reads this at most every 200ms, and at once
-- after a notification (an operator's change to target_control sends one),
-- so a new limit takes effect within that; the main claim
-- (dispatch_claim.sql) skips these targets at once.
SELECT target_topic
FROM target_control
WHERE rate_limit IS NOT NULL AND NOT paused
ORDER BY target_topic
