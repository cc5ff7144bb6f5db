-- Release the keys consumer groups have committed past. $1 (text[]) are
-- groups, $2 (text[]) target topics, $3 (int[]) partitions and $4
-- (bigint[]) the group's committed offset there, all parallel. A committed
-- offset is the next offset the group will read, so a record below it has
-- been consumed and committed: every deferred_inflight row of the group and
-- partition whose record_offset is below it is deleted, and the key is no
-- longer in flight for that group. Returns how many rows went.
--
-- The rows are locked in primary-key order before they are deleted, the
-- order finalize (dispatch_delete.sql) upserts them in; locking them in
-- the index's offset order instead could deadlock with a finalize moving
-- two of those keys to later records. A row such a finalize moved to a
-- record at or past the committed offset meanwhile is checked again on its
-- new version, and stays.
--
-- Every replica runs it, with offsets read at slightly different times: a
-- row another replica deleted first is skipped, and an older committed
-- offset deletes nothing a newer one would not.
WITH committed AS (
    SELECT *
    FROM unnest($1::text[], $2::text[], $3::int[], $4::bigint[]) AS c (group_id, target_topic, partition, next_offset)
), doomed AS (
    SELECT i.group_id, i.business_key, i.target_topic, i.partition
    FROM deferred_inflight i
    JOIN committed c ON c.group_id = i.group_id AND c.target_topic = i.target_topic AND c.partition = i.partition
    WHERE i.record_offset < c.next_offset
    ORDER BY i.group_id, i.business_key, i.target_topic, i.partition
    FOR UPDATE OF i
), gone AS (
    DELETE FROM deferred_inflight i
    USING doomed d, committed c
    WHERE i.group_id = d.group_id AND i.business_key = d.business_key
      AND i.target_topic = d.target_topic AND i.partition = d.partition
      AND c.group_id = i.group_id AND c.target_topic = i.target_topic AND c.partition = i.partition
      AND i.record_offset < c.next_offset
    RETURNING 1
)
SELECT count(*) AS released FROM gone
