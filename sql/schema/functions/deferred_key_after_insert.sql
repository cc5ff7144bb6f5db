-- deferred_key_after_insert: the AFTER INSERT trigger of deferred_message
-- (triggers/deferred_message.sql) that keeps deferred_key's heads.
--
-- Inserts only ever add heads or move a head earlier, so they need not read
-- deferred_message at all: the lowest new message of each key becomes its
-- head unless the key already has a lower one. ON CONFLICT DO UPDATE locks
-- the existing head row even when its WHERE is false, which is what
-- serialises an insert against a concurrent refresh of the same key.
--
-- Head candidates are pending messages and parked messages that hold their
-- key (park_holds_key). A held head's next_run_at is 'infinity'. The
-- throttled flag is set as described in deferred_key_throttle_share.sql:
-- the EXISTS re-reads target_control after the shared advisory lock, and
-- runs only for targets that were throttled. A key that stops being held
-- starts afresh (failures 0, a lease owned by no one cleared; see
-- deferred_key_refresh.sql).
--
-- plan_cache_mode = auto (migration 0016; force_custom_plan before): its
-- statements read the transition table and write deferred_key through its
-- primary key (the ON CONFLICT arbiter), with target_control probed only for
-- throttled targets; no plan choice depends on how many rows the queue
-- tables hold, so a generic plan made on stale statistics costs what a
-- custom one does. Planned on every call, at the small inserts of a
-- moderate load they cost 9 µs of planning per message, the throttle-share
-- call 7 more (docs/benchmarks.md, "Generic plans for the head triggers").

CREATE OR REPLACE FUNCTION deferred_key_after_insert() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = auto
AS $$
DECLARE
    earliest timestamptz;
    throttling text[];
BEGIN
    PERFORM deferred_require_read_committed(TG_TABLE_NAME);
    throttling := deferred_key_throttle_share(ARRAY(SELECT DISTINCT target_topic FROM new_rows WHERE state = 'pending'));
    WITH heads AS (
        INSERT INTO deferred_key AS k (business_key, head_id, head_seq, next_run_at, head_target, held, throttled)
        SELECT business_key, id, seq, next_run_at, target_topic, held,
               NOT held AND target_topic = ANY (throttling)
                   AND EXISTS (SELECT 1 FROM target_control c
                               WHERE c.target_topic = s.target_topic AND (c.paused OR c.rate_limit IS NOT NULL))
        FROM (
            SELECT n.business_key, n.id, n.seq, n.target_topic,
                   n.state = 'parked' AS held,
                   CASE WHEN n.state = 'parked' THEN 'infinity' ELSE n.next_run_at END AS next_run_at,
                   row_number() OVER (PARTITION BY n.business_key ORDER BY n.seq, n.id) AS rank
            FROM new_rows n
            WHERE n.state = 'pending'
               OR (n.state = 'parked' AND n.park_holds_key AND n.business_key IS NOT NULL)
        ) s
        WHERE business_key IS NULL OR rank = 1
        ORDER BY business_key, seq, id
        ON CONFLICT (business_key) DO UPDATE
            SET head_id = excluded.head_id, head_seq = excluded.head_seq, next_run_at = excluded.next_run_at,
                head_target = excluded.head_target, held = excluded.held, throttled = excluded.throttled,
                failures = CASE WHEN k.held AND NOT excluded.held THEN 0 ELSE k.failures END,
                leased_until = CASE WHEN k.held AND NOT excluded.held AND k.leased_by IS NULL THEN NULL
                                    ELSE k.leased_until END
            WHERE (excluded.head_seq, excluded.head_id) < (k.head_seq, k.head_id)
        RETURNING k.next_run_at, k.leased_until
    )
    SELECT min(next_run_at) INTO earliest FROM heads
    WHERE leased_until IS NULL OR leased_until <= now();
    PERFORM deferred_key_notify(earliest);
    RETURN NULL;
END
$$;
