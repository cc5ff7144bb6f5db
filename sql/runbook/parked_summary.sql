-- parked_summary.sql: the parking lot by target topic and reason code.
--
-- What: one row per target topic and reason code (the part of the reason
-- before the first colon: exhausted, permanent, non_retriable, unknown_topic,
-- ...) with the number of parked messages, how many of them hold their
-- business key (later messages of the key wait until the parked one is
-- replayed or cancelled), how many dead-letter copies are still unsent, when
-- the oldest and newest were parked, and the most times any of them was
-- replayed already (a message replayed again and again is a loop to break,
-- not to replay once more). Most messages first.
-- When: the parking lot grows (SchedulerParkingLotGrowing), or before a
-- replay: the reason code says whether the cause is fixed. replay_preview.sql
-- lists the messages of one row, replay.sql sends them again.
-- Call:
--   psql "$DATABASE_URL" -f sql/runbook/parked_summary.sql
SELECT m.target_topic,
       split_part(coalesce(m.reason, ''), ':', 1) AS reason,
       count(*) AS messages,
       count(k.head_id) AS holding_keys,
       count(*) FILTER (WHERE m.dlq_topic IS NOT NULL AND m.dlq_published_at IS NULL) AS dlq_unsent,
       min(coalesce(m.parked_at, m.updated_at)) AS oldest,
       max(coalesce(m.parked_at, m.updated_at)) AS newest,
       max(m.redrive_count) AS max_redrives
FROM deferred_message m
LEFT JOIN deferred_key k ON k.head_id = m.id AND k.held
WHERE m.state = 'parked'
GROUP BY 1, 2
ORDER BY messages DESC, m.target_topic NULLS FIRST, reason;
