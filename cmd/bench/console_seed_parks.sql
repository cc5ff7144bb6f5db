-- The console scenario's seed, step 3 (cmd/bench/console.go): the parks
-- that happen after a message is stored, as dispatch and operators make
-- them, so that the triggers record them ('parked' after 'deferred') and
-- move the keys' heads: messages $1..$2 whose bucket is below 20 are
-- parked by dispatch, the broker having refused them (unknown_topic, as
-- dispatch_park.sql writes), those from 45 to 49 by an operator.
UPDATE deferred_message m
SET state = 'parked',
    reason = CASE WHEN (m.id * 7919) % 1000 < 20
                  THEN 'unknown_topic: the broker has no topic ' || m.target_topic || ' (UNKNOWN_TOPIC_OR_PARTITION)'
                  ELSE 'operator: downstream migration, hold until Monday' END
WHERE m.id BETWEEN $1::bigint AND $2::bigint
  AND m.state = 'pending'
  AND ((m.id * 7919) % 1000 < 20 OR (m.id * 7919) % 1000 BETWEEN 45 AND 49)
