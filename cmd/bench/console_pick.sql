-- The console scenario (cmd/bench/console.go): the message and the key its
-- message and key pages show. The message: the first one dispatch parked
-- that has a key and re-defers a delivered one, so that its history has the
-- most to show (deferred and published in its lineage, then deferred and
-- parked); the key: that message's, whose other messages wait behind it.
SELECT m.id, m.business_key
FROM deferred_message m
WHERE m.state = 'parked' AND m.reason LIKE 'unknown\_topic:%'
  AND m.business_key IS NOT NULL AND m.origin_id IS NOT NULL
ORDER BY m.id
LIMIT 1
