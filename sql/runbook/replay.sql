-- replay.sql: send parked (or rejected) messages again, optionally at a rate.
--
-- What: moves the messages in state :'state' (parked or rejected) that match
-- every filter given back to 'pending', with the reason cleared and
-- redrive_count incremented (republished as defer.redrive-count), and prints
-- them. The filters are those of replay_preview.sql (ids, target, key,
-- error_class, reason, since, until; empty: any), and at least one must be
-- set: with none, nothing moves. A rejected record with no target topic is
-- left alone.
-- :'rate' (messages per second; empty: no pacing) staggers the due times:
-- taken oldest parked first (parked_at, then id), the k-th message (k from 0)
-- is due at now() + k/rate seconds, and the messages of one business key keep
-- their seq order among the times their key gets. Dispatch then sends them at
-- that rate whether or not anyone watches, in per-key order: a replayed
-- message that held its key goes first, and the messages waiting behind it
-- follow (they are not paced; a target's rate limit, limit_target.sql, paces
-- everything). :'reset_attempts' true sets attempt to 0, so the retry policy
-- starts over when the consumer fails again.
-- Rows are locked and the filters checked again as they are moved, so a
-- message that changed since replay_preview.sql (replayed, cancelled,
-- delivered) is not touched. `scheduler replay` runs this file with the ids it
-- previewed and the same filters.
-- When: the cause of the parking is fixed (the topic exists, the ACL was
-- granted, the consumer's bug is deployed). Run replay_preview.sql first with
-- the same filters.
-- Call:
--   psql "$DATABASE_URL" -v state=parked -v ids= -v target='payments.%' -v key= -v error_class= \
--        -v reason=unknown_topic -v since= -v until= -v rate=10 -v reset_attempts=false \
--        -f sql/runbook/replay.sql
WITH picked AS (
    SELECT m.id, m.business_key, m.seq, coalesce(m.parked_at, m.updated_at) AS since
    FROM deferred_message m
    WHERE m.state = :'state'
      AND coalesce(m.target_topic, '') <> ''
      AND (:'ids'::text = '' OR m.id = ANY (string_to_array(:'ids', ',')::bigint[]))
      AND (:'target'::text = '' OR m.target_topic LIKE :'target')
      AND (:'key'::text = '' OR m.business_key = :'key')
      AND (:'error_class'::text = '' OR m.error_class LIKE :'error_class')
      AND (:'reason'::text = '' OR split_part(m.reason, ':', 1) = :'reason')
      AND coalesce(m.parked_at, m.updated_at) >= coalesce(nullif(:'since', '')::timestamptz, '-infinity')
      AND coalesce(m.parked_at, m.updated_at) < coalesce(nullif(:'until', '')::timestamptz, 'infinity')
      -- Never "replay everything" by accident.
      AND concat(:'ids', :'target', :'key', :'error_class', :'reason', :'since', :'until') <> ''
    -- Locking in id order, like every multi-row change, keeps two replays
    -- from deadlocking each other.
    ORDER BY m.id
    FOR UPDATE
), slots AS (
    -- The k-th time slot, oldest parked first.
    SELECT id, business_key, seq, row_number() OVER (ORDER BY since, id) - 1 AS slot
    FROM picked
), ordered AS (
    -- Within one business key, the key's slots go to its messages in seq
    -- order, so that no message of a key comes due before an earlier one.
    -- An unordered message (no key) keeps its own slot.
    SELECT by_seq.id, by_slot.slot
    FROM (SELECT id, business_key,
                 row_number() OVER (PARTITION BY business_key, CASE WHEN business_key IS NULL THEN id END
                                    ORDER BY seq, id) AS n
          FROM slots) by_seq
    JOIN (SELECT id, business_key, slot,
                 row_number() OVER (PARTITION BY business_key, CASE WHEN business_key IS NULL THEN id END
                                    ORDER BY slot) AS n
          FROM slots) by_slot
      ON by_slot.n = by_seq.n
     AND CASE WHEN by_seq.business_key IS NULL THEN by_slot.id = by_seq.id
              ELSE by_slot.business_key = by_seq.business_key END
)
UPDATE deferred_message m
SET state = 'pending',
    reason = NULL,
    redrive_count = m.redrive_count + 1,
    attempt = CASE WHEN :'reset_attempts'::boolean THEN 0 ELSE m.attempt END,
    next_run_at = now() + coalesce(o.slot / nullif(:'rate', '')::float8, 0) * interval '1 second'
FROM ordered o
WHERE m.id = o.id
RETURNING m.id, m.business_key, m.seq, m.target_topic, m.state, m.next_run_at, m.attempt, m.reason, m.redrive_count;
